"""Variants of a model: which one serves a request, by weight, optionally sticky to a conversation.

A model with `variants` (policies/config/variants.py) has one replica set and admission queue per variant
(`model#variant`). Every request of such a model is assigned one live variant (shadow variants get no live
traffic) by a point in [0, 1) falling into the variants' cumulative weight ranges. When the model is `sticky`
the point is a stable hash of the session header's value or of the API key, so every turn of one conversation
lands on the same variant (and its prefix cache) in every gateway process; when the weights change only the
points in the ranges that moved change variant. Otherwise the point is the next of a golden-ratio sequence
(from a random start): as unpredictable to a client as a random draw, but evenly spread, so a 20% canary gets
20% of any run of requests to within a request or two, where independent draws would stray by a binomial
spread (about two points in 500 requests).

Per model the ranges are precomputed into a `Plan` when the policy is loaded or the weights change; a request
costs one dict lookup, one draw or hash and one bisection. A model without variants costs nothing: the step
is only in the pipeline when some model has variants, and then it is one failed dict lookup.

Weights come from the policy file and can be changed live (`PUT /admin/models/{model}/variants`); a reload
of the file resets a model's weights only when the file's weights for it changed, so an unrelated reload
does not undo an operator's change.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from collections.abc import Callable
from functools import partial
from typing import Any

from backends.lora import AdapterTarget
from backends.replicas import group_name
from policies.config import Model, Policy
from policies.finished import Finished
from policies.memo import Memo
from policies.metrics import GatewayMetrics
from policies.pipeline import Call, Slot
from policies.variant_guard import VariantGuard
from policies.variant_signals import ANSWER, Sample, StreamAnswer, Window, compared, sample_of, summary, wants_structure

log = logging.getLogger("gateway.variants")
WeightsChanged = Callable[[str, dict[str, float], dict[str, float], str], None]  # (model, before, after, why)

HEADER = "x-gateway-variant"  # the variant that served a request, in its response headers
_SCALE = float(1 << 64)
GOLDEN = (math.sqrt(5) - 1) / 2  # the step of the evenly spread sequence: it never falls into a short cycle


@dataclass
class LoadMatch:
    """A candidate and its baseline whose load the guard matches (policies/variant_guard.py), until a time or until
    the candidate's `left` calls ran out, whichever comes first: the one record of a load matching."""

    candidate: str
    candidate_group: str
    baseline: str
    baseline_group: str
    until: float  # monotonic
    left: int  # the candidate's calls it may still last


class UnknownVariant(LookupError):
    """A weight change that names a variant or model the policy does not have."""


class NoLiveWeight(ValueError):
    """A weight change that would leave every live variant at weight 0."""


@dataclass(slots=True, eq=False)
class Plan:
    """One model's assignment, built once per change of its weights."""

    names: tuple[str, ...]  # the live (non-shadow) variants, in policy order
    groups: tuple[str, ...]  # their replica sets
    bounds: tuple[float, ...]  # cumulative weight fractions; the last is 1.0
    header: str | None  # sticky on this request header's value
    key: bool  # sticky on the API key (when the header is absent)
    shadows: tuple[tuple[str, str, float], ...] = ()  # (variant, replica set, share of requests copied to it)
    adapters: tuple[AdapterTarget | None, ...] = ()  # the LoRA adapter serving each live variant, if any
    point: float = field(default_factory=random.random)  # the model's evenly spread sequence, from a random start
    shadow_point: float = field(default_factory=random.random)  # the same, for sampling copies to shadows

    def shadow(self) -> tuple[str, str] | None:
        """The shadow variant this request is also sent to, if any (evenly spread at the shadows' shares)."""
        if not self.shadows:
            return None
        self.shadow_point = point = (self.shadow_point + GOLDEN) % 1.0
        for name, group, share in self.shadows:
            if point < share:
                return name, group
            point -= share
        return None

    def index(self, point: float) -> int:
        return min(bisect_right(self.bounds, point), len(self.bounds) - 1)


def plan_of(model: Model, weights: dict[str, float]) -> Plan:
    live = [v for v in model.variants if not v.shadow]
    total = sum(weights[v.name] for v in live)
    bounds, running = [], 0.0
    for v in live:
        running += weights[v.name]
        bounds.append(running / total)
    bounds[-1] = 1.0
    sticky = model.sticky
    shadows = tuple((v.name, group_name(model.name, v.name), min(100.0, weights[v.name]) / 100.0)
                    for v in model.variants if v.shadow and weights[v.name] > 0)
    adapters = tuple(None if v.adapter is None else AdapterTarget(v.adapter.name, v.adapter.path) for v in live)
    return Plan(tuple(v.name for v in live), tuple(group_name(model.name, v.name) for v in live), tuple(bounds),
                sticky.header if sticky else None, bool(sticky and sticky.key), shadows,
                adapters if any(adapters) else ())


def point_of(value: str) -> float:
    """A stable point in [0, 1) for a session id or key id: the same in every process and after restarts."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big") / _SCALE


class Variants:
    """Every model's variants and their current weights; shared by the snapshots of one process."""

    def __init__(self, metrics: GatewayMetrics | None = None) -> None:
        self.metrics = metrics
        self.signals = Memo(partial(Signals, metrics)) if metrics is not None else None
        self.plans: dict[str, Plan] = {}
        self.weights: dict[str, dict[str, float]] = {}  # model -> variant -> weight, as now in force
        self.filed: dict[str, dict[str, float]] = {}  # model -> the weights the policy file last said
        self.models: dict[str, Model] = {}
        self.windows: dict[tuple[str, str], Window] = {}  # (model, variant) -> its last calls' signals
        self.guard = VariantGuard(self, metrics)
        self.load_matches: dict[str, LoadMatch] = {}  # model -> the pair whose load the guard matches now
        # observers of every weight change, each called as (model, before, after, why): the shared state
        # (policies/variant_share.py), the audit log of the gateway's own acts (gateway/admin/system_audit.py)
        self.on_change: list[WeightsChanged] = []

    def configure(self, policy: Policy) -> None:
        """At start and at every reload: take the file's weights for models whose file weights changed."""
        models = {m.name: m for m in policy.models if m.variants}
        for name, model in models.items():
            filed = {v.name: v.weight for v in model.variants}
            if self.filed.get(name) != filed or set(self.weights.get(name, ())) != set(filed):
                self.weights[name] = dict(filed)
                self.end_load_match(name)  # new shares: a load matching of the old ones ends
                self.guard.weights_set(name, filed, "policy file")
            self.filed[name] = filed
        for gone in [n for n in self.weights if n not in models]:
            self.weights.pop(gone)
            self.filed.pop(gone, None)
        self.models = models
        self.plans = {name: plan_of(model, self.weights[name]) for name, model in models.items()}
        for name, match in list(self.load_matches.items()):
            if name not in self.plans or not {match.candidate, match.baseline} <= set(self.plans[name].names):
                self.end_load_match(name)
        for name in models:
            self.publish(name)

    def publish(self, model: str) -> None:
        if self.metrics is not None:
            for variant, weight in self.weights[model].items():
                self.metrics.variant_weight.labels(model, variant).set(weight)

    def set_weights(self, model: str, weights: dict[str, float], why: str = "admin") -> dict[str, float]:
        """Change some variants' weights at once (the others keep theirs); requests already assigned keep
        their variant. Raises UnknownVariant for a name the model lacks, NoLiveWeight when no live weight would be
        left."""
        config = self.models.get(model)
        if config is None:
            raise UnknownVariant(f"model {model} has no variants")
        unknown = set(weights) - set(self.weights[model])
        if unknown:
            raise UnknownVariant(f"model {model} has no variant {', '.join(sorted(unknown))}; it has "
                                 f"{', '.join(self.weights[model])}")
        before = self.weights[model]
        new = {**before, **weights}
        if sum(new[v.name] for v in config.variants if not v.shadow) <= 0:
            raise NoLiveWeight(f"model {model}: at least one variant that is not a shadow needs a weight above 0")
        plan = plan_of(config, new)
        self.weights[model], self.plans[model] = new, plan  # one swap each: a request sees the old or the new
        self.end_load_match(model)
        log.info("model %s: variant weights %s (%s)", model, ", ".join(f"{k}={v:g}" for k, v in new.items()), why)
        self.publish(model)
        self.guard.weights_set(model, weights, why)
        for observer in self.on_change:
            observer(model, before, new, why)
        return new

    def match_load(self, model: str, candidate: str, baseline: str, seconds: float, calls: int) -> None:
        """For `seconds` and the candidate's next `calls` at most, until `end_load_match`: requests of `model` drawn for
        either variant go to the one with fewer in flight per replica (the guard's load matching,
        policies/variant_guard.py)."""
        self.load_matches[model] = LoadMatch(candidate, group_name(model, candidate), baseline, group_name(model, baseline),
                                      time.monotonic() + seconds, calls)

    def load_match_on(self, model: str) -> LoadMatch | None:
        """The model's load matching, if one is on (one past its time is ended here)."""
        match = self.load_matches.get(model)
        if match is not None and time.monotonic() > match.until:  # a candidate that stopped getting calls (down)
            self.end_load_match(model)  # ends it by the clock
            return None
        return match

    def load_match_of(self, model: str, candidate: str) -> LoadMatch | None:
        """The matching of `candidate`'s load, if one is on."""
        match = self.load_match_on(model)
        return match if match is not None and match.candidate == candidate else None

    def end_load_match(self, model: str) -> None:
        self.load_matches.pop(model, None)

    def record(self, model: str, variant: str, sample: Sample, status: int) -> None:
        """One finished call of a variant (live or shadow): its metrics, its window, then its guard's look."""
        if self.signals is not None:
            self.signals(model, variant).add(sample, status)
        self.window(model, variant).add(sample)
        self.guard.after_call(model, variant)

    def adopt(self, model: str, weights: dict[str, float], states: dict[str, dict[str, Any]], why: str) -> None:
        """Take weights and guard verdicts another gateway replica decided (policies/variant_share.py)."""
        current = self.weights.get(model)
        if current is None:
            return
        known = {k: float(v) for k, v in weights.items() if k in current}
        if known and {**current, **known} != current:
            try:
                self.set_weights(model, known, why)
            except NoLiveWeight:
                return
        self.guard.adopt(model, {k: v for k, v in states.items() if k in current})

    def window(self, model: str, variant: str) -> Window:
        window = self.windows.get((model, variant))
        if window is None:
            window = self.windows[(model, variant)] = Window()
        return window

    def report(self, seconds: float | None = None) -> dict[str, Any]:
        """Every model's variants side by side: weight and what their recent answers say."""
        out: dict[str, Any] = {}
        for name, model in self.models.items():
            weights = self.weights[name]
            out[name] = {"variants": [
                {"name": v.name, "weight": weights[v.name], "shadow": v.shadow,
                 **summary(self.window(name, v.name).recent(seconds)), "guard": self.guard.view(name, v.name)}
                for v in model.variants]}
        return out

    def view(self, model: str) -> dict[str, Any] | None:
        config = self.models.get(model)
        if config is None:
            return None
        weights = self.weights[model]
        return {"model": model, "sticky": config.sticky.model_dump() if config.sticky else None,
                "variants": [{"name": v.name, "weight": weights[v.name], "shadow": v.shadow,
                              "filed_weight": v.weight, "guard": self.guard.view(model, v.name)}
                             for v in config.variants]}


# the call's variant was assigned while the variant guard matched the load (policies/variant_guard.py)
LOAD_MATCHED: Slot[bool] = Slot("assigned while load-matched")
# (variant, replica set) of a shadow variant the call is copied to once its answer is under way (gateway/shadow.py)
SHADOW: Slot[tuple[str, str]] = Slot("shadow variant")


class AssignVariant:
    """Pipeline step (after the model is resolved): the variant, hence the replica set, of a request."""

    name = "assign-variant"
    writes = (LOAD_MATCHED, SHADOW, ANSWER)

    def __init__(self, variants: Variants, load: Callable[[str], float] = lambda group: 0.0) -> None:
        self.variants = variants
        self.load = load  # requests in flight per replica of a replica set (backends/replicas.py load_of)

    async def enter(self, call: Call) -> None:
        plan = self.variants.plans.get(call.model)
        if plan is None:
            return
        pinned = call.pinned  # a stored Responses id lives on one replica: its variant it is
        if pinned is not None:
            call.variant, call.group = pinned.variant, pinned.group
            if plan.adapters and pinned.variant in plan.names:
                call.adapter = plan.adapters[plan.names.index(pinned.variant)]
            if pinned.variant is not None:
                call.response_headers[HEADER] = pinned.variant
            return
        value = call.request.headers.get(plan.header) if plan.header is not None and call.request.headers is not None else None
        if not value and plan.key and call.key is not None:
            value = call.key.id
        if value:
            i = plan.index(point_of(value))
        else:
            plan.point = point = (plan.point + GOLDEN) % 1.0
            i = plan.index(point)
            match = self.variants.load_match_on(call.model) if self.variants.load_matches else None
            if match is not None and plan.names[i] in (match.candidate, match.baseline):  # the guard matches their load
                i = self.lighter(plan, match)
                LOAD_MATCHED.put(call, True)
        call.variant = call.response_headers[HEADER] = plan.names[i]
        call.group = plan.groups[i]
        if plan.adapters:
            call.adapter = plan.adapters[i]
        shadow = plan.shadow() if plan.shadows else None
        if shadow is not None:
            SHADOW.put(call, shadow)
        body = call.body
        if body.get("stream"):  # what its signals need, gathered as it passes: text only for structure or a comparison
            ANSWER.put(call, StreamAnswer(wants_structure(body) or (shadow is not None and compared(body))))

    def lighter(self, plan: Plan, match: LoadMatch) -> int:
        """The index of the pair's variant with fewer in flight per replica (ties: the baseline)."""
        lighter = self.load(match.candidate_group) < self.load(match.baseline_group)
        return plan.names.index(match.candidate if lighter else match.baseline)

    async def leave(self, call: Call) -> None:
        pass  # nothing taken; the finished call's signals are VariantSignals' to record


class VariantSignals:
    """Observer of finished calls (policies/finished.py): what each answer of a variant says, into its window."""

    name = "variant-signals"

    def __init__(self, variants: Variants) -> None:
        self.variants = variants

    def observe(self, record: Finished) -> None:
        if record.variant is not None and record.call is not None:
            matched = LOAD_MATCHED.get(record.call) or False
            self.variants.record(record.model, record.variant, sample_of(record.call, record.ended_at, matched),
                                 record.status)


class Signals:
    """The Prometheus children of one variant, looked up once."""

    def __init__(self, metrics: GatewayMetrics, model: str, variant: str) -> None:
        self.model, self.variant = model, variant
        self.requests = metrics.variant_requests  # tallies (policies/tally.py): keyed by the label values,
        self.by_status = Memo(lambda status: (model, variant, str(status)))  # each key tuple made once here
        self.errors = metrics.variant_errors
        self.by_error = Memo(lambda kind: (model, variant, kind))
        self.ttft = Memo(lambda load: metrics.variant_ttft.child((model, variant, load)))  # by load level
        self.itl = Memo(lambda load: metrics.variant_itl.child((model, variant, load)))
        self.tokens_per_second = metrics.variant_tokens_per_second.child((model, variant))
        self.structured = metrics.variant_structured
        self.by_validity = {True: (model, variant, "true"), False: (model, variant, "false")}
        self.length = metrics.variant_length
        self.one = (model, variant)

    def add(self, sample: Sample, status: int) -> None:
        self.requests.add(self.by_status(status))
        if sample.error is not None:
            self.errors.add(self.by_error(sample.error))
        if sample.ttft is not None:
            self.ttft(sample.load)(sample.ttft)
        if sample.itl is not None:
            self.itl(sample.load)(sample.itl)
        if sample.tokens_per_second is not None:
            self.tokens_per_second(sample.tokens_per_second)
        if sample.structured is not None:
            self.structured.add(self.by_validity[sample.structured])
        if sample.length:
            self.length.add(self.one)
