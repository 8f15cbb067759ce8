"""The guard of a model's candidate variants: compared with the baseline over a sliding window, pulled back
at once when worse, promoted step by step while not.

After each call of a candidate (every `EVERY` calls, so the request path stays cheap) its window and the
baseline's (policies/variant_signals.py) over the last `window_seconds` are compared, each signal only once
both sides have `min_samples` of it:

- structured-output validity no more than `max_validity_drop` below the baseline's;
- the variant's own errors (upstream_error, timeout, no_backend) no more than `max_error_increase` above;
- inter-token latency and time to first token p50 no more than `max_itl_ratio` / `max_ttft_ratio` times the
  baseline's at comparable load (in flight to the server when sent, in power-of-two levels): at one level both
  sides met `min_samples` times; the candidate at its level against the baseline's latency modelled at that
  level from the levels it met (so a slowdown smaller than the baseline's own load penalty is seen once the
  baseline met the candidate's load); or the candidate at level L or lighter against the baseline at L or
  heavier (latency does not fall as load rises, so the gap only flatters the candidate); judged on the worst. A
  light canary on a busy model, whose levels never both fill, is thus judged after `min_samples` of its calls,
  and an identical candidate is never blamed for the baseline's heavier load; where only that bound applies,
  `undecided` says what it hides;
- for a shadow, agreement with the live answer at least `min_agreement`.

A breach sets the candidate's weight to 0 at once (Variants.set_weights, so every request after it goes to
the others), logs one warning with the reason, counts llm_gateway_variant_guard_actions_total and keeps the
reason for GET /admin/variants. While some signal the candidate has samples of cannot be judged yet, the view
says why (`undecided`, e.g. "ITL: not enough samples at comparable load: candidate 12/50, baseline 400/50") and
since when (`judging_since`, `undecided_for_s`, the gauge llm_gateway_variant_guard_undecided_seconds), and
`warning` turns true once that has lasted longer than `window_seconds`. The variant stays out until an operator gives it a weight again (admin API or
the file).

Where the two sides never met one load (a steady light canary on a busy model: the candidate near 8 in flight,
the baseline near 32; no level with a quarter of `min_samples` calls on both sides), only the bound of the
candidate at a lighter load judges latency, and a slowdown smaller than the baseline's load penalty hides under
it. (Where the candidate runs heavier, it queues its own calls: that shows at the loads it reaches, and matching
the loads would hide it.) With `match_load` (the default) the guard then matches the two sides' load
for a while (load matching, `Variants.match_load`): requests drawn for either side go to whichever has fewer in flight per replica,
so both run at one load, and each candidate call sent then is judged against the baseline's calls that ran
beside it at its load (`compare_beside`: calls that ran together met the same machine); the load matching ends once a latency signal was
judged at a load both met (or with the verdict), or after `match_load.calls` of the candidate's calls, and
comes at most once per `window_seconds`: then the weights rule again. While it lasts the candidate takes up to
half the pair's traffic; the admin view says so (`load_matching`), and each load matching is counted
(llm_gateway_variant_guard_actions_total{action="even_load"}: the label value keeps the setting's former name,
as dashboards may query it). With `promotion`, a candidate that has held for `after_requests` calls at one step moves to the
next share of traffic (the baseline takes the rest).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from math import log2
from typing import Any, Protocol

from policies.config import Guard, Model
from policies.metrics import GatewayMetrics
from policies.variant_signals import FAULTS, LOAD_LEVELS, Sample, Window, level_key

log = logging.getLogger("gateway.variants")
GUARD = "guard"  # how a weight change the guard makes begins its `why` (the audit log tells it from an admin's)

EVERY = 10  # a candidate's calls between two comparisons
EPSILON = 1e-9  # 1.00 - 0.98 is a hair over 0.02 in floating point: "2 points" must hold at exactly 2
WATCHING, ROLLED_BACK, PROMOTED, BASELINE = "watching", "rolled_back", "promoted", "baseline"


@dataclass
class GuardState:
    state: str = WATCHING
    reason: str | None = None
    at: float | None = None  # unix seconds of the last action
    step: int = -1  # the promotion step reached (-1: none yet)
    held: int = 0  # the candidate's calls since its last step
    calls: int = 0
    undecided: str | None = None  # why some signal could not be judged at the last look (None: all were)
    judging_since: float | None = None  # unix seconds since when some signal has been waiting
    warn_after: float = 300.0  # the guard's window: undecided for longer is worth an operator's look
    ratios: dict[str, float] | None = None  # each latency signal's worst candidate/baseline ratio at the last look
    load_matched_at: float | None = None  # unix seconds the last load matching began (one on is in Variants.load_matches)

    def view(self, matching_left: int) -> dict[str, Any]:
        """`matching_left`: the candidate's calls the matching of its load may still last (0: none on)."""
        waited = round(time.time() - self.judging_since, 1) if self.undecided and self.judging_since else None
        return {"state": self.state, "reason": self.reason, "at": self.at, "step": self.step,
                "undecided": self.undecided if self.state == WATCHING else None,
                "judging_since": self.judging_since if self.state == WATCHING else None,
                "undecided_for_s": waited if self.state == WATCHING else None,
                "warning": self.state == WATCHING and waited is not None and waited > self.warn_after,
                "ratios": self.ratios, "load_matching": matching_left or None, "load_matched_at": self.load_matched_at}


def baseline_of(model: Model) -> str:
    guard = model.guard
    return (guard.baseline if guard and guard.baseline else None) or next(v.name for v in model.variants
                                                                           if not v.shadow)


def verdict(guard: Guard, cand: list[Sample], base: list[Sample]) -> tuple[str, str] | None:
    """The first signal on which the candidate is worse than the baseline: (signal, reason), or None."""
    return judge(guard, cand, base)[0]


def judge(guard: Guard, cand: list[Sample], base: list[Sample], seen: dict[str, float] | None = None,
          blind: list[str] | None = None,
          timed: tuple[list[Sample], list[Sample]] | None = None) -> tuple[tuple[str, str] | None, list[str]]:
    """(breach, waiting): the first signal on which the candidate is worse, or None; and why each signal the
    candidate has samples of could not be judged yet (empty while every one was). `seen` (when given) gets
    each latency signal's worst ratio at comparable load; `blind` the latency signals held only to the bound
    of the baseline at a heavier load (the candidate at lighter loads than any the baseline met). Not those
    where the candidate ran heavier: a candidate that queues its own calls shows it at the loads it reaches, and
    matching its load with the baseline's would hide that. `timed`: the calls whose latency is compared (default: all of `cand` and `base`)."""
    need = guard.min_samples
    waiting: list[str] = []
    if guard.max_validity_drop is not None:
        c = [s.structured for s in cand if s.structured is not None]
        b = [s.structured for s in base if s.structured is not None]
        if len(c) >= need and len(b) >= need:
            rc, rb = sum(c) / len(c), sum(b) / len(b)
            if rb - rc > guard.max_validity_drop + EPSILON:
                return ("structured_validity", (f"structured-output validity {rc:.1%} vs baseline {rb:.1%} (more"
                                                f" than {guard.max_validity_drop * 100:g} points lower, {len(c)}"
                                                f" answers)")), waiting
        elif c:
            waiting.append(f"structured validity: not enough structured answers: candidate {len(c)}/{need},"
                           f" baseline {len(b)}/{need}")
    if guard.max_error_increase is not None:
        if len(cand) >= need and len(base) >= need:
            rc = sum(1 for s in cand if s.error in FAULTS) / len(cand)
            rb = sum(1 for s in base if s.error in FAULTS) / len(base)
            if rc - rb > guard.max_error_increase + EPSILON:
                return ("errors", (f"errors {rc:.1%} vs baseline {rb:.1%} (more than"
                                   f" {guard.max_error_increase * 100:g} points higher, {len(cand)} calls)")), waiting
        else:
            waiting.append(f"errors: not enough calls: candidate {len(cand)}/{need}, baseline {len(base)}/{need}")
    lat_cand, lat_base = timed if timed is not None else (cand, base)
    for signal, limit, (worst, closest, matched) in latency_looks(guard, lat_cand, lat_base):
        if worst is not None and seen is not None:
            seen[signal] = round(worst[0], 3)
        if worst is not None and worst[0] > limit:
            return latency_breach(signal, limit, *worst), waiting
        if worst is None and closest is not None:
            waiting.append(f"{signal.upper()}: not enough samples at comparable load: candidate {closest[0]}/{need},"
                           f" baseline {closest[1]}/{need}")
        elif worst is not None and not matched:
            if blind is not None and not levels_meet(lat_cand, lat_base, signal, max(need // 4, 1)):
                blind.append(signal)
            waiting.append(f"{signal.upper()}: no load level both sides met, nor one the baseline met on each side of"
                           f" the candidate's: held only to the baseline at heavier load ({worst[0]:.2f}x), which"
                           f" hides a slowdown smaller than the baseline's load penalty")
    if guard.min_agreement is not None:
        agreed = [s.agreed for s in cand if s.agreed is not None]
        if len(agreed) >= need and sum(agreed) / len(agreed) < guard.min_agreement:
            return ("agreement", (f"agreement with the live answer {sum(agreed) / len(agreed):.1%} (below"
                                  f" {guard.min_agreement:.0%}, {len(agreed)} compared)")), waiting
    return None, waiting


def levels_meet(cand: list[Sample], base: list[Sample], field: str, least: int) -> bool:
    """Whether some load level has `least` calls of `field` on both sides: the loads do meet, and the traffic
    as it comes will fill that level (no load matching needed, only patience)."""
    counts: dict[str, list[int]] = {}
    for side, samples in ((0, cand), (1, base)):
        for s in samples:
            if getattr(s, field) is not None:
                counts.setdefault(s.load, [0, 0])[side] += 1
    return any(c >= least and b >= least for c, b in counts.values())


def judge_load_matched(guard: Guard, cand: list[Sample], base: list[Sample],
                       seen: dict[str, float]) -> tuple[tuple[str, str] | None, set[str]]:
    """(breach, judged): latency as the calls sent while the two sides' load was matched say it, each of the
    candidate's calls against the baseline's that ran beside it (`compare_beside`): the first latency signal that
    breaches, or None; and the signals that were judged."""
    judged: set[str] = set()
    for signal, limit in latency_limits(guard):
        found = compare_beside(cand, base, signal, guard.min_samples)
        if found is None:
            continue
        judged.add(signal)
        seen[signal] = round(found[0], 3)
        if found[0] > limit:
            return latency_breach(signal, limit, found[0], f"while their load was matched, {found[1]}"), judged
    return None, judged


def compare_beside(cand: list[Sample], base: list[Sample], field: str, need: int) -> tuple[float, str] | None:
    """The median over the candidate's calls of its `field` over the median of the baseline's calls that ran
    beside it (sent before it finished, finished after it was sent) at its load level: (ratio, where),
    once `need` of the candidate's calls had such company and the baseline had `need` calls; else None.

    A load matching sends each new call to the side with fewer in flight, so a side whose calls end together
    takes the next ones in a burst: each side's calls come in turns. On a machine whose speed drifts (other work
    on its cores) one side's turn may fall in a slow moment and the other's in a fast one, and an identical
    candidate's p50 came out 1.25-1.54x the baseline's at one load level. Calls that ran together at one load
    met the same machine: an identical candidate is judged at about 1x however the machine drifts, a slower one
    at its slowdown."""
    known = sorted((s.began, s.at, level_key(s.load), value) for s in base
                   if (value := getattr(s, field)) is not None and s.began is not None)
    if len(known) < need:
        return None
    starts = [began for began, _, _, _ in known]
    longest = max(at - began for began, at, _, _ in known)
    ratios: list[float] = []
    for s in cand:
        value = getattr(s, field)
        if value is None or s.began is None:
            continue
        level = level_key(s.load)
        beside = sorted(v for began, at, lv, v in known[bisect_left(starts, s.began - longest):
                                                        bisect_right(starts, s.at)]
                        if at > s.began and lv == level)
        if beside:
            typical = middle(beside)
            ratios.append(value / typical if typical else 0.0)
    if len(ratios) < need:
        return None
    ratios.sort()
    return middle(ratios), f"each of {len(ratios)} calls against the baseline's beside it at its load"


Latency = tuple[tuple[float, str] | None, tuple[int, int] | None, bool]  # compare_latency's answer


def latency_limits(guard: Guard) -> Iterator[tuple[str, float]]:
    """(signal, limit) for each latency signal the guard checks (a Sample's field of the same name)."""
    for signal, limit in (("itl", guard.max_itl_ratio), ("ttft", guard.max_ttft_ratio)):
        if limit is not None:
            yield signal, limit


def latency_looks(guard: Guard, cand: list[Sample], base: list[Sample]) -> Iterator[tuple[str, float, Latency]]:
    """(signal, limit, compare_latency's answer) for each latency signal the guard checks."""
    for signal, limit in latency_limits(guard):
        yield signal, limit, compare_latency(cand, base, signal, guard.min_samples)


def latency_breach(signal: str, limit: float, ratio: float, where: str) -> tuple[str, str]:
    return signal, f"{signal.upper()} p50 {ratio:.2f}x the baseline's at comparable load (limit {limit:g}x; {where})"


def latency_signals(guard: Guard, cand: list[Sample]) -> set[str]:
    """The latency signals the guard checks that the candidate's calls have samples of."""
    return {signal for signal, _ in latency_limits(guard) if any(getattr(s, signal) is not None for s in cand)}


def latency_ratio(cand: list[Sample], base: list[Sample], field: str, need: int) -> tuple[float, str] | None:
    """The worst candidate-over-baseline ratio of `field`'s p50 at comparable load: (ratio, where), or None."""
    return compare_latency(cand, base, field, need)[0]


def compare_latency(cand: list[Sample], base: list[Sample], field: str, need: int) -> Latency:
    """(worst, closest, matched). `worst`: the highest candidate-over-baseline ratio of `field`'s p50 among the
    comparisons at comparable load that have `need` calls on both sides, as (ratio, where), or None while none
    has. `closest`: (candidate calls, baseline calls) of the comparison nearest to being judged, or None when
    the candidate has no sample of `field`. `matched`: whether some comparison was at matched load (the first
    or third kind below), not only the bound of the second.

    Three kinds of comparison, each sound on its own since latency does not fall as load rises:
    - at one load level, on both sides (a flag that hurts only with company shows only at the levels where the
      candidate had some: per level, not averaged over levels);
    - the candidate at load level L or lighter against the baseline at L or heavier, for each level L the
      candidate met: the load gap can only flatter the candidate, so an identical one never looks worse, while a
      light canary on a busy model is judged as soon as it has `need` calls; but a candidate slower by less
      than the baseline's own load penalty passes it;
    - the candidate at its level L against the baseline's latency modelled at L (`baseline_at`): the
      baseline's per-level medians made non-decreasing in load, at L itself or interpolated between the
      levels around it, each of which has half of `need` calls. So a canary at level 8 is held to what the
      baseline costs at 8, not at 32, as soon as the baseline met some load at or below 8 and some above."""
    by_name: dict[str, tuple[list[float], list[float]]] = {}
    for side, samples in ((0, cand), (1, base)):
        for s in samples:
            value = getattr(s, field)
            if value is not None:
                by_name.setdefault(s.load, ([], []))[side].append(value)
    levels = {level_key(name): values for name, values in by_name.items()}
    worst: tuple[float, str] | None = None
    closest: tuple[int, int] | None = None
    matched = False
    order = sorted(levels)
    for c, b in levels.values():
        c.sort()
        b.sort()
    curve = baseline_curve({level: b for level, (_, b) in levels.items()}, max(need // 2, 1))
    for i, level in enumerate(order):
        here = levels[level][0]
        if not here:
            continue
        name = _level_name(level)
        # sorted runs joined: sorting them again is a merge, not a full sort (a look stays about 1 ms)
        lighter = sorted(chain.from_iterable(levels[k][0] for k in order[:i + 1]))
        heavier = sorted(chain.from_iterable(levels[k][1] for k in order[i:]))
        for c, b, where in ((here, levels[level][1], f"load level {name}"),
                            (lighter, heavier, f"candidate at load level {name} or lighter, baseline at {name} or"
                                               f" heavier")):
            if len(c) >= need and len(b) >= need:
                ratio = middle(c) / middle(b) if middle(b) else 0.0
                matched = matched or c is here
                if worst is None or ratio > worst[0]:
                    worst = (ratio, f"{where}: {len(c)} vs {len(b)} calls")
            elif closest is None or min(len(c), need) + min(len(b), need) > sum(min(n, need) for n in closest):
                closest = (len(c), len(b))
        modelled = baseline_at(curve, level) if len(here) >= need else None
        if modelled is not None:
            value, used = modelled
            matched = True
            ratio = middle(here) / value if value else 0.0
            if worst is None or ratio > worst[0]:
                worst = (ratio, f"load level {name}, the baseline's there modelled from its calls at"
                                f" {' and '.join(map(_level_name, used))}: {len(here)} vs"
                                f" {sum(len(levels[k][1]) for k in used)} calls")
    return worst, closest, matched


def baseline_curve(levels: dict[int, list[float]], least: int) -> dict[int, float]:
    """The baseline's latency against load: the median at each level with `least` calls, made non-decreasing in
    load by carrying the highest median of the lighter levels up (never by lowering a level's own: a light
    level whose median came out high by chance only makes the yardstick longer, never shorter)."""
    curve: dict[int, float] = {}
    highest = 0.0
    for level in sorted(levels):
        if len(levels[level]) >= least:
            highest = max(highest, middle(levels[level]))
            curve[level] = highest
    return curve


def baseline_at(curve: dict[int, float], level: int) -> tuple[float, list[int]] | None:
    """The baseline's modelled latency at `level` and the levels it came from: the curve's own value there,
    or interpolated in log2 of the level between the nearest levels below and above; never extrapolated
    (None). Latency rises with load at least as steeply in the heavier levels as in the lighter ones, so the
    chord lies above the curve: interpolation can only flatter the candidate."""
    if level in curve:
        return curve[level], [level]
    below = max((k for k in curve if k < level), default=None)
    above = min((k for k in curve if k > level), default=None)
    if below is None or above is None:
        return None
    share = (log2(level) - log2(below)) / (log2(above) - log2(below))
    return curve[below] + share * (curve[above] - curve[below]), [below, above]


def middle(known: list[float]) -> float:
    """The median of a sorted, non-empty list."""
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def _level_name(key: int) -> str:
    return str(key) if key <= LOAD_LEVELS[-1] else f">{LOAD_LEVELS[-1]}"


class LoadMatching(Protocol):
    left: int  # the candidate's calls it may still last


class GuardedVariants(Protocol):
    """What the guard reads and changes of policies.variants.Variants (which holds the guard, so it is not
    imported here)."""

    @property
    def models(self) -> Mapping[str, Model]: ...

    @property
    def weights(self) -> Mapping[str, Mapping[str, float]]: ...

    @property
    def load_matches(self) -> Mapping[str, object]: ...

    def window(self, model: str, variant: str) -> Window: ...

    def set_weights(self, model: str, weights: dict[str, float], why: str = ...) -> dict[str, float]: ...

    def match_load(self, model: str, candidate: str, baseline: str, seconds: float, calls: int) -> None: ...

    def load_match_of(self, model: str, candidate: str) -> LoadMatching | None: ...

    def end_load_match(self, model: str) -> None: ...


class VariantGuard:
    """Every guarded model's candidates; their state is read by the admin view."""

    def __init__(self, variants: GuardedVariants, metrics: GatewayMetrics | None = None) -> None:
        self.variants = variants  # policies.variants.Variants
        self.metrics = metrics
        self.states: dict[tuple[str, str], GuardState] = {}

    def state(self, model: str, variant: str) -> GuardState:
        found = self.states.get((model, variant))
        if found is None:
            found = self.states[(model, variant)] = GuardState()
        return found

    def view(self, model: str, variant: str) -> dict[str, Any] | None:
        config = self.variants.models.get(model)
        if config is None or config.guard is None:
            return None
        if variant == baseline_of(config):
            return {"state": BASELINE, "reason": None, "at": None, "step": -1, "undecided": None,
                    "judging_since": None, "undecided_for_s": None, "warning": False, "ratios": None,
                    "load_matching": None, "load_matched_at": None}
        return self.state(model, variant).view(self.load_matching_left(model, variant))

    def load_matching_left(self, model: str, variant: str) -> int:
        match = self.variants.load_match_of(model, variant)
        return match.left if match is not None else 0

    def weights_set(self, model: str, weights: dict[str, float], why: str) -> None:
        """Weights changed (any load matching of the model was ended with them: the shares are new): a variant an
        operator (or the file) gave a weight again is watched again."""
        if why.startswith("guard"):
            return
        for variant, weight in weights.items():
            st = self.states.get((model, variant))
            if st is not None and st.state == ROLLED_BACK and weight > 0:
                self.states[(model, variant)] = GuardState()

    def adopt(self, model: str, views: dict[str, dict[str, Any]]) -> None:
        """Verdicts another gateway replica's guard reached (policies/variant_share.py)."""
        for variant, view in views.items():
            st = self.state(model, variant)
            st.state, st.reason, st.at, st.step = view["state"], view.get("reason"), view.get("at"), view.get("step", -1)

    def after_call(self, model: str, variant: str) -> None:
        config = self.variants.models.get(model)
        if config is None or config.guard is None:
            return
        guard = config.guard
        base = baseline_of(config)
        if variant == base:
            return
        st = self.state(model, variant)
        if st.state == ROLLED_BACK:
            return
        st.calls += 1
        st.held += 1
        match = self.variants.load_match_of(model, variant)  # None too once ended by the clock (module doc)
        if match is not None:
            if match.left <= 1:
                self.stop_load_matching(model, variant, f"after {guard.match_load.calls if guard.match_load else 0} of its"
                                                  f" calls")
            else:
                match.left -= 1
        if st.calls % EVERY:
            return
        cand = self.variants.window(model, variant).recent(guard.window_seconds)
        baseline = self.variants.window(model, base).recent(guard.window_seconds)
        st.ratios = {}
        blind: list[str] = []
        # latency from the calls sent while the load was matched is compared only with each other (same times, same
        # loads), the rest with the rest: a candidate's calls crowded into one load matching are never held against a
        # baseline's spread over the window, whose machine may have been less busy
        plain = ([s for s in cand if not s.load_matched], [s for s in baseline if not s.load_matched]) \
            if st.load_matched_at is not None else None
        breach, waiting = judge(guard, cand, baseline, st.ratios, blind, plain)
        all_judged = False  # every latency signal the last load matching's calls have was judged on them
        if breach is None and st.load_matched_at is not None:  # what the calls sent while the load was matched say
            matched_cand = [s for s in cand if s.load_matched]
            breach, judged = judge_load_matched(guard, matched_cand, [s for s in baseline if s.load_matched], st.ratios)
            blind = [signal for signal in blind if signal not in judged]
            waiting = [w for w in waiting if not w.startswith(tuple(f"{signal.upper()}:" for signal in judged))]
            all_judged = bool(judged) and judged >= latency_signals(guard, matched_cand)
        if breach is not None:
            self.waiting(model, variant, st, guard, waiting)
            self.roll_back(model, variant, *breach)
            return
        matching = self.load_matching_left(model, variant)
        if matching and all_judged:
            self.stop_load_matching(model, variant, "judged at a load both met")
        elif blind and not matching:
            self.start_load_matching(config, variant, base, st, blind[0])
        self.waiting(model, variant, st, guard, waiting)
        if guard.promotion is not None and st.state == WATCHING and st.held >= guard.promotion.after_requests \
                and len(cand) >= guard.min_samples:
            self.promote(config, variant, base, st)

    def start_load_matching(self, config: Model, variant: str, base: str, st: GuardState, signal: str) -> None:
        """Match the two sides' load for a while (module doc), unless it is off, came within the window already,
        another candidate's load matching is on, or requests cannot be moved (stickiness on the key, no live weight)."""
        guard = config.guard
        match = guard.match_load if guard is not None else None
        now = time.time()
        weights = self.variants.weights.get(config.name, {})
        if match is None or guard is None or (st.load_matched_at is not None and now - st.load_matched_at < guard.window_seconds) \
                or config.name in self.variants.load_matches or (config.sticky is not None and config.sticky.key) \
                or not weights.get(variant) or not weights.get(base):
            return
        st.load_matched_at = now
        self.variants.match_load(config.name, variant, base, guard.window_seconds, match.calls)
        log.info("variant guard: model %s: no load both %s and %s met; matching their load for up to %d of %s's"
                 " calls", config.name, variant, base, match.calls, variant)
        if self.metrics is not None:
            self.metrics.variant_guard_actions.labels(config.name, variant, "even_load", signal).inc()

    def stop_load_matching(self, model: str, variant: str, why: str) -> None:
        self.variants.end_load_match(model)
        log.info("variant guard: model %s: the load matching of %s ended (%s); the weights rule again", model,
                 variant, why)

    def waiting(self, model: str, variant: str, st: GuardState, guard: Guard, waiting: list[str]) -> None:
        """Keep why the guard could not judge yet, and since when (the admin view; the metric's seconds)."""
        now = time.time()
        st.warn_after = guard.window_seconds
        matching = self.load_matching_left(model, variant)
        if matching:
            waiting = [*waiting, f"matching the two sides' load for up to {matching} more of its calls"]
        st.undecided = "; ".join(waiting) or None
        since = st.judging_since = (st.judging_since or now) if waiting else None
        if self.metrics is not None:
            self.metrics.variant_guard_undecided.labels(model, variant).set(now - since if since is not None else 0)

    def roll_back(self, model: str, variant: str, signal: str, reason: str) -> None:
        st = self.state(model, variant)
        before = self.variants.weights[model][variant]
        st.state, st.reason, st.at = ROLLED_BACK, reason, time.time()
        self.variants.set_weights(model, {variant: 0.0}, why=f"{GUARD}: {reason}")
        log.warning("variant guard: model %s variant %s rolled back (weight %g -> 0): %s", model, variant, before,
                    reason)
        if self.metrics is not None:
            self.metrics.variant_guard_actions.labels(model, variant, "rollback", signal).inc()

    def promote(self, config: Model, variant: str, base: str, st: GuardState) -> None:
        guard = config.guard
        assert guard is not None and guard.promotion is not None  # after_call promotes only then
        steps = guard.promotion.steps
        st.step += 1
        st.held = 0
        share = steps[st.step]
        others = sum(w for name, w in self.variants.weights[config.name].items()
                     if name not in (variant, base) and not next(v for v in config.variants if v.name == name).shadow)
        st.reason, st.at = f"promoted to {share:g}% after the guard held", time.time()
        if st.step == len(steps) - 1:
            st.state = PROMOTED
        self.variants.set_weights(config.name, {variant: share, base: max(0.0, 100.0 - share - others)},
                                  why=f"{GUARD}: {st.reason}")
        log.info("variant guard: model %s variant %s promoted to %g%% of its traffic", config.name, variant, share)
        if self.metrics is not None:
            self.metrics.variant_guard_actions.labels(config.name, variant, "promote", "held").inc()
