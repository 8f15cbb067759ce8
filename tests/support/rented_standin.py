"""A stand-in for a rented OpenAI-compatible API, run as its own process on loopback.

It requires its own API key (401 otherwise, quoting a fragment of the bad key the way real providers do, so
tests can check the gateway never relays that) and appends every request it receives to a JSON-lines log:
the request id, path, model, whether the key matched and the trace context headers it got. Replies are small and immediate.

    python -m tests.support.rented_standin --port 9100 --key-env STANDIN_KEY --log /tmp/rented.jsonl

`--usage spaced` writes its JSON as Python's json.dumps does (`"usage": {`, `"choices": []`) with usage first
and an unknown field in it; `--usage omitted` never sends usage (some providers do not, on streams).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import orjson
import uvicorn

from tests.support.asgi import lifespan, read_body
from tests.support.servers import free_port

TRACE_HEADERS = ("traceparent", "tracestate", "baggage")  # logged, so tests see what trace context got out


def make_app(key: str, log_path: str, usage_style: str = "compact", name: str = ""):
    def dumps(value: dict) -> bytes:
        if usage_style == "compact":
            return orjson.dumps(value)
        if "usage" in value:  # usage first, an unknown field in it, and json.dumps's spacing
            value = {"usage": {"completion_tokens": 5, "vendor_cache": {"hit": 0}, **value["usage"]}, **value}
        return json.dumps(value).encode()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["path"] == "/health":
            await respond(send, 200, {"standin": name})  # its name: a starter knows it is this process that answers
            return
        raw = await read_body(receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        body = orjson.loads(raw) if raw else {}
        authorized = headers.get("authorization") == f"Bearer {key}"
        with open(log_path, "a") as log:
            log.write(json.dumps({"request_id": headers.get("x-request-id"), "path": scope["path"],
                                  "model": body.get("model"), "authorized": authorized, "at": time.time(),
                                  "trace": {h: headers[h] for h in TRACE_HEADERS if h in headers}}) + "\n")
        if not authorized:
            given = headers.get("authorization", "")[-4:]
            error = {"message": f"Incorrect API key provided: ...{given}", "type": "invalid_request_error",
                     "param": None, "code": "invalid_api_key"}
            await respond(send, 401, {"error": error})
            return
        usage = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
        if body.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            chunk = {"id": "rent-1", "object": "chat.completion.chunk", "model": body.get("model"),
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "rented"},
                                  "finish_reason": "stop"}]}
            await send({"type": "http.response.body", "body": b"data: " + dumps(chunk) + b"\n\n",
                        "more_body": True})
            if (body.get("stream_options") or {}).get("include_usage") and usage_style != "omitted":
                tail = {**chunk, "choices": [], "usage": usage}
                await send({"type": "http.response.body", "body": b"data: " + dumps(tail) + b"\n\n",
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        answer = {
            "id": "rent-1", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "rented"}, "finish_reason": "stop"}],
            "usage": usage,
        }
        if usage_style == "omitted":
            del answer["usage"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": dumps(answer)})

    return app


async def respond(send, status: int, body: dict) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


def read_log(path: str) -> list[dict]:
    try:
        with open(path) as log:
            return [json.loads(line) for line in log if line.strip()]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def running_standin(monkeypatch, log: str, *extra: str) -> Iterator[tuple[str, str]]:
    """The stand-in in a process of its own on a free loopback port, with a fresh key in STANDIN_KEY (the env var
    a test's policy names as the provider's key), logging to `log`: its /v1 URL and the key; stopped on exit."""
    key = "rk-" + secrets.token_urlsafe(24)
    monkeypatch.setenv("STANDIN_KEY", key)
    port, proc = started(log, extra)
    try:
        yield f"http://127.0.0.1:{port}/v1", key
    finally:
        proc.terminate()
        proc.wait(10)


def started(log: str, extra: tuple[str, ...], tries: int = 5) -> tuple[int, subprocess.Popen]:
    """The stand-in's process and port, once it answers there under its own name. A free port can be taken by
    another test's server before the stand-in binds it (the stand-in then exits, and the other server would
    answer /health): such a start is tried again on another port, `tries` times at most."""
    for _ in range(tries):
        name, port = secrets.token_hex(8), free_port()
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.rented_standin", "--port", str(port),
                                 "--key-env", "STANDIN_KEY", "--log", log, "--name", name, *extra], env={**os.environ})
        if answers_as(port, proc, name, 20):
            return port, proc
        proc.terminate()
        proc.wait(10)
    raise AssertionError(f"the rented stand-in did not start on any of {tries} ports")


def answers_as(port: int, proc: subprocess.Popen, name: str, timeout: float) -> bool:
    """Whether the stand-in `name` answers on `port` within `timeout` (False once its process exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            if reply.status_code == 200 and reply.json().get("standin") == name:
                return True
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key-env", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--usage", choices=("compact", "spaced", "omitted"), default="compact")
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    uvicorn.run(make_app(os.environ[args.key_env], args.log, args.usage, args.name), host="127.0.0.1", port=args.port,
                log_level="warning")
