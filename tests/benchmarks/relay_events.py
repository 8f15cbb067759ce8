"""What the SSE relay costs per event (gateway/relay.py), by kind of event: a plain chunk, a chunk with
`"usage":null` (OpenAI sends one on every chunk when usage is asked for) and the final usage event.

    .venv/bin/python -m tests.benchmarks.relay_events [path/to/relay.py ...]

With paths, each file is measured in turn (e.g. an older revision's relay, written out with `git show`).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import timeit

import orjson

CHUNK = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}]}
EVENTS = {
    "plain chunk": b"data: " + orjson.dumps(CHUNK) + b"\n\n",
    'chunk with "usage":null': b"data: " + orjson.dumps({**CHUNK, "usage": None}) + b"\n\n",
    "final usage event": b"data: " + orjson.dumps({**CHUNK, "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}) + b"\n\n",
}


def measure(relay_module, label: str, n: int = 200_000) -> None:
    for name, event in EVENTS.items():
        relay = relay_module.SSERelay(strip_usage=True)
        best = min(timeit.repeat(functools.partial(relay.feed, event), number=n, repeat=7))
        print(f"{label:24s} {name:26s} {best / n * 1e9:6.0f} ns/event")


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"relay_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    if len(sys.argv) > 1:
        for path in sys.argv[1:]:
            measure(load(path), path[-24:])
    else:
        from gateway import relay

        measure(relay, "gateway/relay.py")
