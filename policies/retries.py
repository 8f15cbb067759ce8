"""The retry budget of one model: retries may add at most a set share to its request rate.

A sliding window of `SLOTS` slots counts the model's requests (first attempts) and its retries; a retry is
allowed while the window's retries stay under `budget` times its requests plus `min_retries` (so a model with
little traffic may still retry a failed request). When every replica fails, retries stop at that share: an
outage is never amplified into a storm (Finagle's RetryBudget, Envoy's retry budget).

The request path pays for it with one clock value it already has and a few integer operations (`request`);
the slots move on only when time crossed into another one. Times are passed in (seconds of any monotonic
clock), so the window is tested with a clock of the test's own.
"""

from __future__ import annotations

SLOTS = 10


class RetryBudget:
    __slots__ = ("budget", "min_retries", "per_slot", "tick", "slot", "requests", "retries", "in_requests",
                 "in_retries")

    def __init__(self, budget: float, window: float, min_retries: int) -> None:
        self.budget = budget
        self.min_retries = min_retries
        self.per_slot = SLOTS / window  # slots per second
        self.tick = 0  # the slot number (time x per_slot) the counts were last moved to
        self.slot = 0  # tick % SLOTS: where the current slot's counts are
        self.requests = [0] * SLOTS
        self.retries = [0] * SLOTS
        self.in_requests = self.in_retries = 0  # summed over the window's slots

    def request(self, now: float) -> None:
        """One request of the model started at `now` (its first attempt)."""
        tick = int(now * self.per_slot)
        if tick != self.tick:
            self._move(tick)
        self.requests[self.slot] += 1
        self.in_requests += 1

    def try_retry(self, now: float) -> bool:
        """May a request be retried at `now`? If so, the retry is counted."""
        tick = int(now * self.per_slot)
        if tick != self.tick:
            self._move(tick)
        if self.in_retries >= self.budget * self.in_requests + self.min_retries:
            return False
        self.retries[self.slot] += 1
        self.in_retries += 1
        return True

    def _move(self, tick: int) -> None:
        """Empty the slots time has left behind since the last move (all of them after a window's quiet)."""
        if tick < self.tick:  # a clock that went back: count on in the current slot
            return
        for passed in range(self.tick + 1, min(tick, self.tick + SLOTS) + 1):
            slot = passed % SLOTS
            self.in_requests -= self.requests[slot]
            self.in_retries -= self.retries[slot]
            self.requests[slot] = self.retries[slot] = 0
        self.tick, self.slot = tick, tick % SLOTS

    def counts(self) -> tuple[int, int]:
        """(requests, retries) in the window, as of the last call."""
        return self.in_requests, self.in_retries
