"""The access log: one line per request (id, endpoint, model, backend, status, stream, duration, the variant
for a model with variants, the attempts of one retried on another replica, and the migrations of a stream that
went on from another replica), never headers.

Through the `logging` module a line costs a LogRecord, a format and a write syscall on the request path; on
the benchmark that was ~7% of the gateway's CPU per request. So a process started by the CLI (which owns
stderr) writes the lines itself: formatted like every other log line, buffered, and written in one call at
most every `FLUSH_EVERY` seconds. Elsewhere (a gateway embedded in another program, the tests) each line goes
through the `gateway.access` logger as usual. Either way the line is written only when that logger is
enabled for INFO.

With the policy's `access_log.format: json` each line is one JSON object instead, with the call's trace id
(its own, or the client's traceparent's when tracing is off), so a log pipeline can join lines to traces.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TextIO

import orjson

from gateway.attempts import ATTEMPTS_HEADER
from gateway.migration import MIGRATIONS_HEADER
from gateway.tracing.context import trace_id_of
from policies.finished import Finished
from policies.pipeline import Call

log = logging.getLogger("gateway.access")

FLUSH_EVERY = 0.1
MAX_PENDING = 512  # lines buffered before a write is forced


class AccessLog:
    """An observer of finished calls (policies/finished.py): one line each."""

    name = "access-log"
    stream: TextIO | None = None  # set by the CLI (gateway/cli/__init__.py): write there, batched

    def __init__(self, json: bool = False) -> None:
        self.json = json
        self.pending: list[str] = []
        self.flush_handle: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    def observe(self, record: Finished) -> None:
        backend = record.replica.name if record.replica is not None else "none"
        self.write(record.request_id, record.endpoint, record.model or "unknown", backend, record.status,
                   record.stream, record.elapsed, record.call)

    def write(self, request_id: str, endpoint: str, model: str, backend: str, status: int, stream: bool,
              elapsed: float, call: Call | None = None) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        if self.json:
            self.write_json(request_id, endpoint, model, backend, status, stream, elapsed, call)
            return
        message = (f"request_id={request_id} endpoint={endpoint} model={model} backend={backend} status={status}"
                   f" stream={stream} duration_ms={elapsed * 1000:.1f}")
        if call is not None and call.variant is not None:
            message += f" variant={call.variant}"
        if call is not None and ATTEMPTS_HEADER in call.response_headers:  # retried on another replica
            message += f" attempts={call.response_headers[ATTEMPTS_HEADER]}"
        if call is not None and MIGRATIONS_HEADER in call.response_headers:  # went on from another replica
            message += f" migrations={call.response_headers[MIGRATIONS_HEADER]}"
        if self.stream is None:
            log.info("%s", message)
            return
        self.pending.append(f"{self.timestamp()} INFO gateway.access {message}\n")
        if len(self.pending) >= MAX_PENDING:
            self.flush()
        elif self.flush_handle is None:
            self.flush_handle = asyncio.get_running_loop().call_later(FLUSH_EVERY, self.flush)

    def write_json(self, request_id: str, endpoint: str, model: str, backend: str, status: int, stream: bool,
                   elapsed: float, call: Call | None) -> None:
        record = {"time": time.time(), "level": "INFO", "logger": "gateway.access", "request_id": request_id,
                  "trace_id": trace_id_of(call) if call is not None else "", "endpoint": endpoint, "model": model,
                  "backend": backend, "status": status, "stream": stream, "duration_ms": round(elapsed * 1000, 1)}
        if call is not None and call.variant is not None:
            record["variant"] = call.variant
        if call is not None and ATTEMPTS_HEADER in call.response_headers:
            record["attempts"] = int(call.response_headers[ATTEMPTS_HEADER])
        if call is not None and MIGRATIONS_HEADER in call.response_headers:
            record["migrations"] = int(call.response_headers[MIGRATIONS_HEADER])
        line = orjson.dumps(record).decode()
        if self.stream is None:
            log.info("%s", line)
            return
        self.pending.append(line + "\n")
        if len(self.pending) >= MAX_PENDING:
            self.flush()
        elif self.flush_handle is None:
            self.flush_handle = asyncio.get_running_loop().call_later(FLUSH_EVERY, self.flush)

    def timestamp(self) -> str:
        """As logging's default asctime: 2026-12-02 14:28:37,123."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"

    def flush(self) -> None:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if self.pending and self.stream is not None:
            lines, self.pending = "".join(self.pending), []
            try:
                self.stream.write(lines)
                self.stream.flush()
            except (OSError, ValueError):  # stderr closed: nothing sensible left to do with a log line
                pass


def write_to_stderr() -> None:
    """Called by the CLI once it has configured logging to stderr."""
    AccessLog.stream = sys.stderr
