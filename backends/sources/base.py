"""The interface every source of replicas implements, and what it reports."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("gateway.discovery")


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str  # an IP address, as the source reports it
    port: int
    ready: bool = True

    def url(self, scheme: str) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{scheme}://{host}:{self.port}"


Emit = Callable[[list[Endpoint]], None]


class Source(Protocol):
    kind: str

    def start(self, emit: Emit) -> None: ...

    def stop(self) -> None: ...


class Watcher:
    """Runs `body(stopped)` in a daemon thread, again after any failure (with a pause), until stopped.

    The Kubernetes client is synchronous; one thread per watch keeps its blocking reads off the event loop.
    """

    def __init__(self, name: str, body: Callable[[threading.Event], None], retry: float = 1.0) -> None:
        self.name, self.body, self.retry = name, body, retry
        self.stopped = threading.Event()
        self.stream = None  # the kubernetes Watch reading now: stopping it unblocks the thread's read
        self.thread = threading.Thread(target=self._run, name=f"watch {name}", daemon=True)

    def new_stream(self):
        from kubernetes import watch

        self.stream = watch.Watch()
        return self.stream

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        stream = self.stream
        if stream is not None:
            stream.stop()  # shuts the socket down: the watch's connection closes now, not at its timeout

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.body(self.stopped)
            except Exception as exc:  # noqa: BLE001 - the API server restarts, tokens rotate: watch again
                if not self.stopped.is_set():
                    log.warning("watch of %s failed, retrying in %g s: %s", self.name, self.retry, exc)
            self.stopped.wait(self.retry)
