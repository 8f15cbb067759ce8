"""A stand-in for policies/pipeline.py's Call with the fields tracing reads (gateway/tracing/tracer.py,
gateway/tracing/spans.py): for driving the tracer without a request path."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from policies.pipeline import Request


@dataclass
class Key:
    id: str = "key-1"


@dataclass
class Call:
    request_id: str
    headers: dict = field(default_factory=dict)
    body: dict = field(default_factory=lambda: {"model": "m", "max_tokens": 16, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Say hello."}]})
    endpoint: str = "chat/completions"
    model: str = "m"
    stream: bool = False
    status: int = 200
    key: Any = field(default_factory=Key)
    error: Any = None
    queue_wait: float = 0.0
    first_token_at: float = 0.0
    arrived: float = field(default_factory=time.perf_counter)
    response: Any = None
    usage: Any = None
    tap: Any = None
    state: dict = field(default_factory=dict)  # the trace, in gateway/tracing/context.py's TRACE slot
    request: Request = field(init=False)  # what the client asked, made of the fields above as the edge makes it

    def __post_init__(self) -> None:
        self.request = Request(self.request_id, self.endpoint, self.headers, "127.0.0.1", self.arrived)
