"""Watching the Kubernetes API so that a dead connection is noticed, healed, and seen.

A watch is a long HTTP response the API server writes events to. A TCP flow can die without a close (a
dropped NAT entry, a dead node): the socket then reads nothing, forever, and routing goes stale. Three bounds:

- a client read timeout (`read_timeout`) on every request, the watch stream included: no byte for that long and
  the connection is dropped. The watch asks for bookmarks (`allowWatchBookmarks`): the API server then writes
  one about every minute, so a healthy stream is never silent past the default 90 s. A stream that has sent
  bookmarks and goes silent is a hang: it counts as a failure. One that never sent any (a server without
  bookmarks) is only quiet: it is listed again at once, as cheap as a reconnect;
- a full list every `relist_every` seconds whatever the watch says (the backstop for events lost in transit):
  the watch asks the server to end it then, and a timer shuts it down should the server not;
- a connect timeout.

A change is therefore applied within `read_timeout` + one backoff step + one list, even through a frozen flow.

A failure (the API server down, refusing, timing out; any exception at all, SystemExit included: importing
the kserve SDK once exited the thread) is retried with capped, jittered exponential backoff, and shows: the
watch's state turns `broken` with ONE warning line, and ONE info line says when it recovered. Retries inside
urllib3 are off for this client (the watch retries itself), which also silences urllib3's retry warnings.
The last known endpoints keep serving meanwhile: an API-server outage must not empty the routing table.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.sources.base import log

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from kubernetes.watch import Watch


@dataclass(frozen=True, slots=True)
class WatchTimings:
    read_timeout: float = 90.0  # no byte for this long on a list or a watch: the connection is dropped
    connect_timeout: float = 10.0
    relist_every: float = 300.0  # a full list at least this often
    backoff_initial: float = 0.5  # the first retry after a failure; doubled per failure...
    backoff_max: float = 30.0  # ...up to this; each pause is jittered down to half of it

    def request_timeout(self) -> tuple[float, float]:
        return (self.connect_timeout, self.read_timeout)

    def backoff(self, failures: int) -> float:
        """The pause after the `failures`-th failure in a row: exponential, capped, with full jitter in its
        upper half (many gateway pods must not reconnect to a recovering API server in step)."""
        ceiling = min(self.backoff_max, self.backoff_initial * 2.0 ** min(failures - 1, 30))
        return ceiling * random.uniform(0.5, 1.0)


class Stalled(Exception):
    """A watch that had been sending bookmarks went silent past the read timeout."""


def describe(exc: BaseException) -> str:
    """A failure in one short line: never the response body or headers an ApiException carries."""
    status = getattr(exc, "status", None)
    if status is not None and hasattr(exc, "reason"):
        return f"HTTP {status} {exc.reason}"[:200]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__


class Watcher:
    """Runs `body(stopped)` in a daemon thread, again after any failure (with backoff), until stopped; keeps
    the state that metrics and /admin/replicas show.

    The Kubernetes client is synchronous; one thread per watch keeps its blocking reads off the event loop.
    `body` calls `synced()` each time it has heard from the API server (a list, an event, a bookmark) and
    returns to be run again at once (a relist); anything it raises is a failure.
    """

    def __init__(self, name: str, body: Callable[[threading.Event], None], timings: WatchTimings) -> None:
        self.name, self.body, self.timings = name, body, timings
        self.stopped = threading.Event()
        self.stream: Watch | None = None  # the kubernetes Watch reading now: stopping it unblocks the thread's read
        self.state = "starting"  # starting (never synced yet), ok, broken
        self.last_sync: float | None = None  # unix seconds the API server was last heard from
        self.broken_since: float | None = None
        self.failures = 0  # in all, for the metric
        self.in_a_row = 0
        self.error: str | None = None  # the last failure, while broken
        self.lock = threading.Lock()
        self.thread = self._thread()

    def _thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"watch {self.name}", daemon=True)

    def new_stream(self) -> Watch:
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

    def synced(self) -> None:
        with self.lock:
            self.last_sync = time.time()
            if self.state == "broken":
                log.info("watch of %s recovered after %.1f s (%d failed attempts)", self.name,
                         self.last_sync - (self.broken_since or self.last_sync), self.in_a_row)
            self.state, self.in_a_row, self.broken_since, self.error = "ok", 0, None, None

    def failed(self, exc: BaseException) -> float:
        """Record a failure; the pause before the next attempt."""
        with self.lock:
            self.failures += 1
            self.in_a_row += 1
            self.error = describe(exc)
            pause = self.timings.backoff(self.in_a_row)
            if self.state != "broken":
                self.state, self.broken_since = "broken", time.time()
                log.warning("watch of %s broke: %s; retrying with backoff (at most %g s apart), its replicas stay"
                            " as last seen until it recovers", self.name, self.error, self.timings.backoff_max)
            else:
                log.debug("watch of %s still failing (%d in a row, next try in %.1f s): %s", self.name,
                          self.in_a_row, pause, self.error)
            return pause

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                began = time.monotonic()
                try:
                    self.body(self.stopped)
                    # a relist is due: at once, unless the server ends every stream as soon as it opens it
                    pause = 0.0 if time.monotonic() - began >= 1 else self.timings.backoff_initial
                except BaseException as exc:  # noqa: BLE001 - any death of the watch is retried, SystemExit included
                    if self.stopped.is_set():
                        return
                    pause = self.failed(exc)
                self.stopped.wait(pause)
        finally:
            if not self.stopped.is_set():  # only a failure in the failure handling itself gets here
                log.error("watch of %s: its thread ended unexpectedly; starting it again", self.name)
                self.stopped.wait(self.timings.backoff_max)
                self.thread = self._thread()
                self.thread.start()


class ListWatch:
    """List, then watch from the list's resourceVersion, as client-go's reflector does; again after
    `relist_every`, after a silent stream, and after a 410 (the version is too old to resume from).

    `list_call(**kwargs)` is a kubernetes client list method with its positional arguments bound;
    `listed(items)` gets every object the list returned, `event(kind, item)` each change (objects as JSON).
    """

    def __init__(self, name: str, api: ApiClient, list_call: Callable[..., object],
                 listed: Callable[[list[dict[str, Any]]], None], event: Callable[[str, dict[str, Any]], None],
                 timings: WatchTimings, **kwargs: str) -> None:
        self.api, self.list_call, self.listed, self.event, self.kwargs = api, list_call, listed, event, kwargs
        self.watcher = Watcher(name, self.run, timings)

    def run(self, stopped: threading.Event) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import ReadTimeoutError

        timings, watcher = self.watcher.timings, self.watcher
        listed = self.api.sanitize_for_serialization(
            self.list_call(**self.kwargs, _request_timeout=timings.request_timeout()))
        self.listed([i for i in listed.get("items") or [] if isinstance(i, dict)])
        watcher.synced()
        version = (listed.get("metadata") or {}).get("resourceVersion")
        relist_at = time.monotonic() + timings.relist_every
        heartbeats = False  # the server has sent a bookmark: its silence then means a dead flow
        stream = watcher.new_stream()
        # the server ends the stream at the relist (timeout_seconds); so does this timer, should it not
        relist = threading.Timer(timings.relist_every, stream.stop)
        relist.daemon = True
        relist.start()
        try:
            for event in stream.stream(self.list_call, **self.kwargs, allow_watch_bookmarks=True,
                                       timeout_seconds=max(1, round(timings.relist_every)),
                                       resource_version=version if version and version.isdigit() else None,
                                       _request_timeout=timings.request_timeout()):
                if stopped.is_set() or time.monotonic() >= relist_at:
                    return
                if not isinstance(event, dict) or not isinstance(event.get("raw_object"), dict):
                    continue  # a blank line
                watcher.synced()
                if event.get("type") == "BOOKMARK":
                    heartbeats = True
                else:
                    self.event(event.get("type", ""), event["raw_object"])
        except ReadTimeoutError:
            if heartbeats and not stopped.is_set():
                raise Stalled(f"no event or bookmark for {timings.read_timeout:g} s on an open watch") from None
            # quiet, and this server sends no bookmarks: list again, as cheap as a reconnect
        except ApiException as exc:
            if exc.status != 410:
                raise
            # too old to resume from: list again
        except Exception:
            if time.monotonic() < relist_at:
                raise
            # the relist timer shut the stream down: list again
        finally:
            relist.cancel()
