"""Serving a call as attempts on owned replicas: which failures may go to another replica, and whether this one
may (the retries of issue "failures the client never sees"; design.md's ninth shape, for owned replicas).

A request goes to another replica, never one it already tried, when its attempt failed before anything reached
the client: the connection could not be made (`ConnectFailed`), broke before the answer's head (`Broken`), no
head came within the read timeout (`ReadTimedOut`), or the head said 5xx or 429. At most `retries.attempts`
times per request, and only while the model's retry budget allows (policies/retries.py). A streamed body was
read once, so an upload is sent again only when it never left (a connect failure). What came after the first
byte to the client is never retried: the proxy asks here only before it returns the answer's head.

Failures are told apart by their class (backends/http1.py), not by a string. The proxy calls `started` once
per call (a dict look-up and a few integer operations) and the rest only when something failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from backends.http1 import Broken, ConnectFailed, ReadTimedOut, UpstreamError
from backends.replicas import Replica, ReplicaSet
from gateway.http.form_upload import UPLOAD
from policies.config import Ejection, Model, Retries
from policies.ejection import Ejections
from policies.metrics import GatewayMetrics
from policies.pipeline import Call
from policies.retries import RetryBudget

CONNECT, RESET, TIMEOUT, STATUS_5XX, STATUS_429 = "connect", "reset", "timeout", "status_5xx", "status_429"
DEFAULT = Retries()
ATTEMPTS_HEADER = "x-gateway-attempts"  # on an answer (or error) that took more than one attempt


def failure_of(error: UpstreamError) -> str | None:
    """Why an attempt that raised `error` may be retried elsewhere (the metric's reason), or None: it may not
    (a write timeout, a body past the gateway's bounds)."""
    if isinstance(error, ConnectFailed):
        return CONNECT
    if isinstance(error, ReadTimedOut):
        return TIMEOUT
    if isinstance(error, Broken):
        return RESET
    return None


def status_failure(status: int) -> str:
    """Why an answer with `status`, a 5xx or a 429 (nothing else is retried), may be retried elsewhere."""
    return STATUS_5XX if status >= 500 else STATUS_429


class Attempts:
    """The retry rules of one policy snapshot: each model's settings and budget (kept across reloads while its
    settings stay), and outlier ejection (whose state lives on the replicas)."""

    def __init__(self, replicas: ReplicaSet, metrics: GatewayMetrics, models: Iterable[Model] = (),
                 previous: Attempts | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        models = list(models)
        self.replicas = replicas
        self.metrics = metrics
        self.clock = clock
        self.settings = {m.name: m.retries for m in models}
        self.budgets: dict[str, RetryBudget] = {}
        if previous is not None:  # a reload: a model whose retry settings stayed keeps its window
            self.budgets = {name: budget for name, budget in previous.budgets.items()
                            if previous.settings.get(name, DEFAULT) == self.settings.get(name, DEFAULT)}
        self.ejections = Ejections(replicas, Ejection(), {m.name: m.ejection for m in models}, on_eject=self._ejected)

    def started(self, model: str, now: float) -> None:
        """A call of `model` makes its first attempt at `now` (perf_counter seconds)."""
        budget = self.budgets.get(model)
        if budget is None:
            settings = self.settings.get(model, DEFAULT)
            budget = self.budgets[model] = RetryBudget(settings.budget, settings.window, settings.min_retries)
        budget.request(now)

    def retry(self, call: Call, reason: str, tried: Sequence[Replica], exclude: Sequence[Replica]) -> bool:
        """May `call`, whose latest attempt failed for `reason`, go to another replica? Counts the retry (or the
        budget's refusal) when one was there to go to."""
        settings = self.settings.get(call.model, DEFAULT)
        if len(tried) > settings.attempts or self.clock() >= call.request.deadline:
            return False  # no attempt left, or its client no longer waits (policies/deadline.py)
        if reason != CONNECT and UPLOAD.get(call) is not None:
            return False  # an upload's body went out as it came: there is none to send again
        group = self.replicas.by_model.get(call.group or call.model, ())
        if not any(r.routable and r not in exclude for r in group):
            return False
        budget = self.budgets.get(call.model)
        if budget is not None and not budget.try_retry(self.clock()):
            self.metrics.retry_budget_exhausted.labels(call.model).inc()
            return False
        self.metrics.retries.labels(call.model, reason).inc()
        call.response_headers[ATTEMPTS_HEADER] = str(len(tried) + 1)
        return True

    def migrations(self, model: str) -> int:
        """How many times a stream of `model` may go on from another replica (gateway/migration.py)."""
        return self.settings.get(model, DEFAULT).migrations

    def _ejected(self, replica: Replica, rule: str) -> None:
        self.metrics.replica_ejections.labels(replica.model, replica.name, rule).inc()
