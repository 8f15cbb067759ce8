"""uvicorn with a drain on SIGTERM, so that a rolling update loses no request.

uvicorn alone closes its listener the moment SIGTERM arrives, while a Kubernetes Service keeps routing new
connections to the pod until its endpoints are updated everywhere (seconds): those are refused. Here SIGTERM
starts a drain instead:

1. at once, /ready answers 503 (the pod leaves the Service's endpoints) while every route keeps serving, and
   each response carries `Connection: close`, so keep-alive clients reconnect and land on another pod;
2. after `server.drain_seconds`, uvicorn's graceful shutdown: the listener and idle connections close, and
   requests in flight (streams) have `server.shutdown_timeout` seconds to finish before they are cancelled;
3. the lifespan's shutdown flushes the access log and the usage counters, and the process exits 0.

A second SIGTERM ends the drain early. SIGINT (Ctrl-C) skips the drain, as before; a second one forces exit.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

log = logging.getLogger("gateway.http.server")

CONNECTION_CLOSE = (b"connection", b"close")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_seconds: float, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.on_drain = on_drain  # called from the signal handler: must only flip state, never block or log
        self.drain_until: float | None = None
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or not self.started or self.should_exit:
            super().handle_exit(sig, frame)  # SIGINT, or SIGTERM before serving: uvicorn's own behaviour
        elif self.drain_until is None:
            self.drain_until = time.monotonic() + self.drain_seconds
            self.close_connections()  # now, not at the next tick: /ready's 503 and this header come together
            self.on_drain()
        else:
            self.should_exit = True  # a second SIGTERM: stop draining now (not re-raised: a graceful exit)

    def close_connections(self) -> None:
        """Every response from now on says `Connection: close` (only state is flipped: safe in a handler)."""
        headers = self.server_state.default_headers
        if CONNECTION_CLOSE not in headers:
            self.server_state.default_headers = [*headers, CONNECTION_CLOSE]

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)  # refreshes the default headers once a second
        if self.drain_until is None:
            return should_exit
        if not self._drain_logged:
            self._drain_logged = True
            log.warning("SIGTERM: draining for %g s (/ready answers 503, requests are still served), then "
                        "closing the listener and waiting up to %g s for requests in flight",
                        self.drain_seconds, self.config.timeout_graceful_shutdown)
        self.close_connections()  # again: uvicorn's tick above rebuilt the default headers without it
        if time.monotonic() >= self.drain_until:
            if not self.should_exit:
                log.warning("drain over: closing the listener")
            self.should_exit = True
        return should_exit or self.should_exit
