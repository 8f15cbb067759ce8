"""Where to cap a backend: the knee of its throughput-vs-concurrency curve, bounded by a TTFT SLO.

A vLLM server's output tokens/s rise with concurrency until its batch (or the host) saturates; past that
point more requests in flight only queue and time to first token explodes. The cap we recommend is:

1. The usable curve. Levels are sorted by concurrency and cut at the first level with any error (a server
   that failed at c is not trusted at c or above), then at the highest throughput (going past the peak never
   helps; the H200 table falls from 10.5k to 7.8k tok/s after 128).
2. The knee: the Kneedle point (Satopaa et al., 2011) of that curve. x = log2(concurrency) and y =
   throughput are both scaled to [0, 1]; the knee is the level where y - x is largest, i.e. the point
   furthest above the chord from the first level to the peak. log2 on x because sweeps double the
   concurrency: every step then weighs the same, while on a linear x the largest level dominates the scale and
   squeezes all small levels onto x = 0. If no point bulges above the chord by MIN_BULGE (the curve is still
   rising steeply in log space, as on the H200 up to 128), there is no knee before the peak and the peak is it.
   Levels that score within TIE of the best are a tie that measurement noise decides (a 1-core CPU vLLM
   capped at 8 scores 4 and 8 alike); latency breaks it: among them the knee is the Kneedle point of TTFT
   p99, which rises slowly and then explodes, so the level where x - y (normalized TTFT) is largest.
3. Climb while it pays and the backend does not queue. Kneedle sees only the curve's shape; where the curve
   bends gradually its point can sit a level below the one where the batch fills (a one-core CPU vLLM with
   --max-num-seqs 8: Kneedle says 4, at 83% of the peak, while 8 still adds 21% and vLLM's queue is empty).
   So from the knee, move up one level while the next one gains at least CLIMB_GAIN in throughput, vLLM's
   own waiting gauge stayed below QUEUED there (requests waiting inside vLLM mean the batch is full: more
   concurrency past that only adds latency), and TTFT p99 grew at most CLIMB_TTFT times (doubling the
   requests in one batch roughly doubles the wait for a first token; much more is the explosion the knee is
   about, as on the talk's GPU: 277 -> 1,300 ms from 32 to 64 for +12%). Without the gauge (a server that
   does not export it) no climb.
4. The guards, on whichever path chose the level (a Kneedle knee, the peak when there is no knee, the best of
   fewer than 3 levels, a plateau, a peak before a cliff): never a level where vLLM's mean waiting reached
   QUEUED or whose TTFT p99 is more than CLIMB_TTFT times the level below's (per doubling). Step down until a level passes
   (the smallest level always can be the answer: there is nothing safer to offer). A peak that queues was
   recommended before: a CPU vLLM with --max-num-seqs 8 peaked at 16 with 7 requests waiting and TTFT p99 5.4x
   the level-8 value, and no knee bulged above the chord, so the peak went out unchecked.
5. With an SLO on TTFT p99: the largest level such that it and every level below it meet the SLO.
6. The recommendation is the smaller of 4 and 5.

Degenerate curves are decided without Kneedle, deterministically: fewer than 3 usable levels -> the best
throughput level (the smaller one on a tie); a flat curve (max within FLAT of min) -> the smallest level,
since concurrency buys nothing; no usable level -> no recommendation, with the reason.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

MIN_BULGE = 0.03  # a knee must rise this far above the chord (in normalized units); noise stays below it
FLAT = 0.05  # a curve whose throughput varies less than this fraction of its peak is flat
TIE = 0.05  # throughput scores this close are decided by latency
CLIMB_GAIN = 0.10  # a level above the knee is taken when it adds at least this much throughput...
QUEUED = 0.5  # ...vLLM's mean number of waiting requests there stayed below this...
CLIMB_TTFT = 3.0  # ...and its TTFT p99 is at most this many times the level below's

METHOD = ("kneedle on (log2 concurrency, output tok/s), cut at the first error level and at peak throughput; "
          f"scores within {TIE} decided by kneedle on TTFT p99; no bulge of {MIN_BULGE} -> the peak; "
          f"then up while the next level gains >= {CLIMB_GAIN:.0%} with vLLM's mean waiting < {QUEUED} and "
          f"TTFT p99 at most {CLIMB_TTFT:g}x; then down past any level with vLLM's mean waiting >= {QUEUED} or TTFT "
          f"p99 over {CLIMB_TTFT:g}x the level below's; "
          "recommended = min(knee, largest level whose TTFT p99 and all below meet the SLO)")


@dataclass(frozen=True)
class Point:
    """One measured level, as far as the knee cares."""

    concurrency: int
    throughput: float  # output tokens per second
    ttft_p99: float | None = None  # seconds
    errors: int = 0
    waiting: float | None = None  # vLLM's mean num_requests_waiting during the level (None: not exported)


@dataclass
class Knee:
    knee: int | None  # from the throughput curve alone
    slo_level: int | None  # largest level meeting the SLO (None: no SLO given, or none meets it)
    recommended: int | None  # the cap to set
    reason: str
    slo_ttft_p99: float | None = None
    scores: dict[int, float] = field(default_factory=dict)  # Kneedle's y - x per level, for the report

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["scores"] = {str(c): round(s, 4) for c, s in self.scores.items()}
        out["method"] = METHOD
        return out


def find_knee(points: list[Point], slo_ttft_p99: float | None = None) -> Knee:
    """The recommended concurrency cap for one backend; pure, so it is tested on synthetic curves."""
    usable, cut = _usable(points)
    if not usable:
        return Knee(None, None, None, cut or "no measured level", slo_ttft_p99)
    knee, scores, why = _kneedle(usable)
    knee, why = _climb(usable, knee, why)
    knee, why = _guard(usable, knee, why)
    slo_level = None
    if slo_ttft_p99 is not None:
        for p in usable:
            if p.ttft_p99 is None or p.ttft_p99 > slo_ttft_p99:
                break
            slo_level = p.concurrency
    if slo_ttft_p99 is not None and slo_level is None:
        reason = f"{why}; but TTFT p99 misses the {slo_ttft_p99 * 1000:.0f} ms SLO even at c={usable[0].concurrency}"
        return Knee(knee, None, None, _join(reason, cut), slo_ttft_p99, scores)
    recommended = knee if slo_level is None else min(knee, slo_level)
    if slo_ttft_p99 is not None and slo_level is not None and slo_level < knee:
        why += f"; capped at c={slo_level}, the largest level within the {slo_ttft_p99 * 1000:.0f} ms TTFT p99 SLO"
    return Knee(knee, slo_level, recommended, _join(why, cut), slo_ttft_p99, scores)


def _join(reason: str, cut: str) -> str:
    return f"{reason} ({cut})" if cut else reason


def _usable(points: list[Point]) -> tuple[list[Point], str]:
    """Sorted levels before the first error level; a note on what was cut."""
    by_level: dict[int, Point] = {}
    for p in points:
        if p.concurrency >= 1 and math.isfinite(p.throughput):
            by_level[p.concurrency] = p
    usable: list[Point] = []
    for c in sorted(by_level):
        p = by_level[c]
        if p.errors:
            return usable, f"levels from c={c} up are excluded: c={c} had {p.errors} errors"
        if p.throughput > 0:
            usable.append(p)
    return usable, ""


def _kneedle(usable: list[Point]) -> tuple[int, dict[int, float], str]:
    """(knee level, scores, why) for a non-empty, sorted, error-free curve."""
    best = max(usable, key=lambda p: (p.throughput, -p.concurrency))
    if len(usable) < 3:
        return best.concurrency, {}, f"fewer than 3 usable levels: the best throughput level c={best.concurrency}"
    lo, hi = min(p.throughput for p in usable), best.throughput
    if hi - lo <= FLAT * hi:
        c = usable[0].concurrency
        return c, {}, f"flat curve (within {FLAT:.0%}): concurrency buys nothing, smallest level c={c}"
    curve = usable[: usable.index(best) + 1]
    if len(curve) < 3:
        return best.concurrency, {}, f"throughput peaks at c={best.concurrency}, before any knee"
    x0, x1 = math.log2(curve[0].concurrency), math.log2(curve[-1].concurrency)
    y0, y1 = curve[0].throughput, curve[-1].throughput
    scores = {p.concurrency: (p.throughput - y0) / (y1 - y0) - (math.log2(p.concurrency) - x0) / (x1 - x0)
              for p in curve}
    # The first max wins exact ties, so the smaller (safer) cap is chosen.
    knee = max(curve[1:], key=lambda p: (scores[p.concurrency], -p.concurrency))
    if scores[knee.concurrency] < MIN_BULGE:
        return best.concurrency, scores, f"no knee before the throughput peak: the peak c={best.concurrency}"
    tied = [p for p in curve[1:] if scores[p.concurrency] >= scores[knee.concurrency] - TIE]
    latency = _latency_scores(curve)
    why = ""
    if len(tied) > 1 and latency:
        knee = max(tied, key=lambda p: (latency[p.concurrency], -p.concurrency))
        why = f"; c={','.join(str(p.concurrency) for p in tied)} tied on throughput, TTFT p99 decided"
    return knee.concurrency, scores, (f"kneedle knee at c={knee.concurrency} "
                                      f"({knee.throughput:.0f} tok/s, {knee.throughput / hi:.0%} of the peak){why}")


def _climb(usable: list[Point], knee: int, why: str) -> tuple[int, str]:
    """Step 3: up from the knee while the next level pays and vLLM does not queue there."""
    at = next(i for i, p in enumerate(usable) if p.concurrency == knee)
    start = at
    while at + 1 < len(usable):
        here, above = usable[at], usable[at + 1]
        if above.waiting is None or above.throughput < here.throughput * (1 + CLIMB_GAIN) or _fault(above, here):
            break
        at += 1
    if at == start:
        return knee, why
    top = usable[at]
    return top.concurrency, (f"{why}; raised to c={top.concurrency} ({top.throughput:.0f} tok/s): each level up to"
                             f" it added >= {CLIMB_GAIN:.0%} with vLLM's queue empty and TTFT p99 at most"
                             f" {CLIMB_TTFT:g}x")


def _guard(usable: list[Point], knee: int, why: str) -> tuple[int, str]:
    """Step 4: down from the chosen level while vLLM queues there or its TTFT exploded against the level below."""
    at = next(i for i, p in enumerate(usable) if p.concurrency == knee)
    refused = []
    while at > 0:
        fault = _fault(usable[at], usable[at - 1])
        if fault is None:
            break
        refused.append(f"c={usable[at].concurrency} {fault}")
        at -= 1
    if not refused:
        return knee, why
    return usable[at].concurrency, f"{why}; lowered to c={usable[at].concurrency}: {', '.join(refused)}"


def _fault(level: Point, below: Point) -> str | None:
    """Why `level` must not be the cap (None: it may be)."""
    if level.waiting is not None and level.waiting >= QUEUED:
        return f"has vLLM waiting {level.waiting:.2g} (>= {QUEUED})"
    # CLIMB_TTFT per doubling: sweeps double the level, and a sparse one (1, 32, 64) may skip several
    allowed = CLIMB_TTFT ** max(1.0, math.log2(level.concurrency / below.concurrency))
    if level.ttft_p99 and below.ttft_p99 and level.ttft_p99 > allowed * below.ttft_p99:
        return f"has TTFT p99 {level.ttft_p99 / below.ttft_p99:.1f}x c={below.concurrency}'s (> {allowed:g}x)"
    return None


def _latency_scores(curve: list[Point]) -> dict[int, float]:
    """Kneedle's x - y on (log2 concurrency, TTFT p99), or {} when TTFT is missing or flat."""
    ttfts = [p.ttft_p99 for p in curve if p.ttft_p99 is not None]
    if len(ttfts) < len(curve) or max(ttfts) <= min(ttfts):
        return {}
    x0, x1 = math.log2(curve[0].concurrency), math.log2(curve[-1].concurrency)
    lo, hi = min(ttfts), max(ttfts)
    return {p.concurrency: (math.log2(p.concurrency) - x0) / (x1 - x0) - (ttft - lo) / (hi - lo)
            for p, ttft in zip(curve, ttfts, strict=True)}
