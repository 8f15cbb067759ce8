"""Small probes the tests share: wait for a process's HTTP endpoint, read one metric from a Prometheus text."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_http_ok(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll `url` until it answers 200 (a gateway's `/ready`: until every model is ready, not only the process);
    fail early if `proc` exits, and after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = httpx.get(url, timeout=1)
            if reply.status_code == 200 and (not url.endswith("/ready") or reply.json().get("status") == "ready"):
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} was not ready after {timeout} s")
        time.sleep(0.1)


async def eventually(predicate, timeout: float = 20.0, every: float = 0.05) -> None:
    """Await `predicate()` until it is true; the bound is generous because these machines are slow and shared."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(every)
    raise AssertionError(f"condition not reached within {timeout:g} s")


class LoopStalls:
    """Within `async with`, the longest time this event loop could not run a 10 ms timer on time (`worst`, in
    seconds): a timed figure taken while the shared machine stalled the process (a GC pause, a stolen CPU) is
    the machine's, not the code's."""

    def __init__(self, every: float = 0.01):
        self.every = every
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.every)
            self.worst = max(self.worst, loop.time() - start - self.every)

    async def __aenter__(self) -> LoopStalls:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
