"""A lean streaming load client: N closed-loop workers, each on its own keep-alive HTTP/1.1 connection.

    python -m tests.benchmarks.peers.sse_client --url URL --model M [--auth 'Bearer ...'] \
        --concurrency 64 --duration 3 --warmup-streams 8

Raw asyncio streams on uvloop, no HTTP library: the request is one prebuilt byte string, the response is read
by Content-Length or chunked framing, and events are counted as `data:` lines (`data: [DONE]` excluded). A
stream is good when it answered 200, carried at least `--expect` events and ended with `data: [DONE]`.
Each worker keeps starting streams until `duration` has passed (a stream started before then runs to its
end), so a slow system still completes at least one stream per worker. Prints one JSON line:
streams, good, events, seconds (first start to last end), token events/s and time-to-last-byte percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from urllib.parse import urlsplit

import orjson

DONE = b"data: [DONE]"


def request_bytes(host: str, port: int, model: str, auth: str | None) -> bytes:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me a story."}],
                         "max_tokens": 256, "stream": True, "stream_options": {"include_usage": True}})
    head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            "Accept: text/event-stream", f"Content-Length: {len(body)}"]
    if auth:
        head.append(f"Authorization: {auth}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, keep_alive) of one HTTP/1.1 response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length, chunked, keep_alive = None, False, True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
        elif name == b"connection" and value == b"close":
            keep_alive = False
    if chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the empty line
                    pass
                break
            parts.append((await reader.readexactly(size + 2))[:-2])
        return status, b"".join(parts), keep_alive
    if length is not None:
        return status, await reader.readexactly(length), keep_alive
    return status, await reader.read(), False  # delimited by close


class Totals:
    def __init__(self) -> None:
        self.streams = self.good = self.events = 0
        self.ttlb: list[float] = []
        self.errors: list[str] = []
        self.first = self.last = 0.0


async def worker(host: str, port: int, request: bytes, until: float, expect: int, totals: Totals | None) -> None:
    reader = writer = None
    try:
        while True:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            start = time.perf_counter()
            writer.write(request)
            status, body, keep_alive = await read_response(reader)
            end = time.perf_counter()
            if totals is not None:
                events = body.count(b"data:") - body.count(DONE)
                totals.streams += 1
                ok = status == 200 and events >= expect and body.rstrip().endswith(DONE)
                if ok:
                    totals.good += 1
                    totals.events += events
                    totals.ttlb.append(end - start)
                elif len(totals.errors) < 5:
                    totals.errors.append(f"HTTP {status}, {events} events: {body[:160]!r}")
                totals.first = min(totals.first or start, start)
                totals.last = max(totals.last, end)
            if not keep_alive:
                writer.close()
                writer = None
            if time.perf_counter() >= until:
                return
    finally:
        if writer is not None:
            writer.close()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


async def main_async(args) -> dict:
    parts = urlsplit(args.url)
    host, port = parts.hostname, parts.port or 80
    request = request_bytes(host, port, args.model, args.auth)
    if args.warmup_streams > 0:  # one stream on each of a few connections: the path is warm, not the system
        await asyncio.wait_for(asyncio.gather(*(worker(host, port, request, 0.0, args.expect, None)
                                                for _ in range(args.warmup_streams))), args.hard_timeout)
    totals = Totals()
    until = time.perf_counter() + args.duration
    tasks = [worker(host, port, request, until, args.expect, totals) for _ in range(args.concurrency)]
    await asyncio.wait_for(asyncio.gather(*tasks), args.hard_timeout)
    seconds = totals.last - totals.first
    return {
        "streams": totals.streams, "good": totals.good, "events": totals.events, "seconds": seconds,
        "events_per_s": totals.events / seconds if seconds > 0 else 0.0,
        "token_events_per_s": totals.good * args.expect / seconds if seconds > 0 else 0.0,
        "ttlb_p50_ms": (pct(totals.ttlb, 50) or 0) * 1000, "ttlb_p99_ms": (pct(totals.ttlb, 99) or 0) * 1000,
        "errors": totals.errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--auth")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup-streams", type=int, default=8, help="streams before measuring, one per worker")
    parser.add_argument("--expect", type=int, default=256, help="token events a good stream carries at least")
    parser.add_argument("--hard-timeout", type=float, default=120.0, help="give up on a phase after this long")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(main_async(args))
    else:
        result = uvloop.run(main_async(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
