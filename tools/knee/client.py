"""One timed streaming chat completion, and vLLM's load gauges from /metrics.

The SSE parser is deliberately minimal: it splits the raw bytes on newlines, keeps `data:` lines and
decodes each with orjson. The client's own cost per chunk must stay far below the server's inter-token
latency, or at high concurrency the sweep measures the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import orjson

from backends.vllm_stats import parse_metrics

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass(slots=True)
class Sample:
    """What one request did; times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    ttft: float | None = None  # seconds to the first chunk that carries output text
    gaps: list[float] = field(default_factory=list)  # seconds between successive output chunks
    tokens: int = 0  # usage.completion_tokens (output chunks when the server sends no usage)
    chunks: int = 0  # chunks that carried output text
    first_chunk: float = 0.0  # when the first and the last of them arrived
    end_chunk: float = 0.0
    prompt_tokens: int | None = None
    error: str | None = None


def chat_body(model: str, prompt: str, max_tokens: int) -> bytes:
    return orjson.dumps({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every request produces exactly max_tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    })


async def _data_lines(resp: httpx.Response) -> AsyncIterator[bytes]:
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()


async def stream_chat(client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str],
                      timeout: float, on_chunk: Callable[[float], None] | None = None) -> Sample:
    """POST one streaming chat completion; never raises for what the server or network does.

    on_chunk(time) is called for every chunk that carries output, also of a request cancelled midway.
    """
    sample = Sample(start=time.perf_counter())
    last, done = None, False
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode("utf-8", "replace")
                    sample.error = f"HTTP {resp.status_code}: {text}"
                else:
                    async for data in _data_lines(resp):
                        now = time.perf_counter()
                        if data == b"[DONE]":
                            done = True
                            break
                        event = orjson.loads(data)
                        if "error" in event:
                            sample.error = f"stream error: {str(event['error'])[:300]}"
                            break
                        choices = event.get("choices")
                        if choices and (choices[0].get("delta") or {}).get("content"):
                            sample.chunks += 1
                            if on_chunk is not None:
                                on_chunk(now)
                            if last is None:
                                sample.ttft = now - sample.start
                                sample.first_chunk = now
                            else:
                                sample.gaps.append(now - last)
                            last = sample.end_chunk = now
                        usage = event.get("usage")
                        if usage and not choices:
                            sample.tokens = int(usage.get("completion_tokens") or 0)
                            sample.prompt_tokens = usage.get("prompt_tokens")
                    if sample.error is None and not done:
                        sample.error = "stream ended without [DONE]"
    except TimeoutError:
        sample.error = f"timeout after {timeout:g} s"
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:300]
    except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
        sample.error = f"bad stream: {exc}"[:300]
    sample.end = time.perf_counter()
    if sample.error is None and not sample.tokens:
        sample.tokens = sample.chunks
    return sample


def parse_gauges(text: str) -> dict[str, float]:
    """Each of GAUGES summed over its series (one per engine), read by the gateway's own scraper's parser."""
    stats = parse_metrics(text)
    values = dict(zip(GAUGES, (stats.running, stats.waiting, stats.kv_usage)))
    return {name: value for name, value in values.items() if value is not None}


async def scrape_gauges(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, float] | None:
    try:
        resp = await client.get(url + "/metrics", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_gauges(resp.text) if resp.status_code == 200 else None
