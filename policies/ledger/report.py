"""Own or rent, per model, from a window of the ledger: the figures and a plain recommendation.

The framework (docs/field-notes.md): an owned GPU costs the same whether it works or idles, so what a token
costs on it depends on how busy it was; steady, high utilisation favours owning ("if it is not always
working, what are you paying for?"), bursty, low traffic favours renting, and the usual answer in between is
to own the base load and rent the bursts.

For each model over the window:
  utilisation            time its owned backends had at least one request in flight / (window x backends)
  batch                  the part of the owned figures that Batch API lines used (requests, tokens, queue
                         time): work that filled idle owned capacity rather than work that needed it at once
  average in flight      requests in flight on average, against the backend's cap (how full its batch was;
                         `batch_fill` for all the model's capped backends together)
  owned cost             every owned backend's hourly price (+ power) x the window, busy or not
  owned cost per million owned cost / owned tokens x 10^6: what a token cost at that utilisation
  owned at rented price  the owned tokens priced at the rented provider's per-token price
  rent-all cost          that, plus what the rented overflow actually cost: renting every request
  actual cost            what was paid: the owned cost plus the rented overflow
  estimated requests     rented calls whose provider sent no usage (a stream that ended without it): charged
                         the gateway's estimate of their tokens, never zero, and counted here so the rented
                         cost can be weighed knowing how much of it is an estimate
  own-all cost           an estimate of owning enough for every request: the owned cost scaled by all tokens /
                         owned tokens, assuming the added capacity would have run at the measured utilisation
                         (a lower bound when the overflow came in bursts: capacity sized for a peak idles more)
  burstiness             peak / mean of requests per bucket (per minute at the default bucket_seconds) over the
                         window (1 = perfectly steady)
  break-even utilisation the utilisation at which owning would have cost what renting did, if tokens grow
                         with busy time
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from policies.config import Policy, backend_name
from policies.ledger.sums import BUSY, COMPLETION, COST, ESTIMATED, HELD, PROMPT, QUEUE, REQUESTS, Row

BURSTY = 3.0  # peak-to-mean of requests per minute from which traffic counts as bursty
HIGH_UTILISATION = 0.5
MAX_POINTS = 1440  # points of a report's series: a day of one-minute buckets


@dataclass(frozen=True)
class Prices:
    input: float  # per million prompt tokens
    output: float  # per million completion tokens
    provider: str


@dataclass(frozen=True)
class BackendCost:
    name: str
    per_hour: float | None  # None: no price declared
    cap: int | None


@dataclass(frozen=True)
class ModelCosts:
    name: str
    backends: list[BackendCost]
    rented: Prices | None  # None: no provider to compare with


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def build_report(rows: list[tuple[Row, list[float]]], models: list[ModelCosts], since: float, until: float,
                 bucket_seconds: int, teams: dict[str, str] | None = None) -> dict[str, Any]:
    """The report for [since, until) (unix seconds; `until` no later than now). `teams` (key id -> team) adds
    each team's calls summed, as each key's are."""
    seconds = max(until - since, 1e-9)
    out: dict[str, Any] = {"since": since, "until": until, "window_seconds": seconds, "bucket_seconds": bucket_seconds,
                           "models": {}, "keys": {}, "teams": {}}
    by_model: dict[str, list[tuple[Row, list[float]]]] = {}
    for row, values in rows:
        by_model.setdefault(row.model, []).append((row, values))
        if row.key_id:
            add_calls(out["keys"], row.key_id, row, values)
            team = (teams or {}).get(row.key_id)
            if team:
                add_calls(out["teams"], team, row, values)
    for model in models:
        out["models"][model.name] = model_report(model, by_model.get(model.name, []), since, seconds,
                                                 bucket_seconds)
    return out


def add_calls(into: dict[str, dict[str, Any]], name: str, row: Row, values: list[float]) -> None:
    """A row's calls added to `name`'s figures (a key's or a team's)."""
    figures = into.setdefault(name, {"requests": 0, "tokens": 0, "rented_requests": 0, "rented_cost": 0.0,
                                     "batch_requests": 0})
    figures["requests"] += int(values[REQUESTS])
    figures["tokens"] += int(values[PROMPT] + values[COMPLETION])
    if row.served == "rented":
        figures["rented_requests"] += int(values[REQUESTS])
        figures["rented_cost"] = round(figures["rented_cost"] + values[COST], 9)
    elif row.served == "batch":
        figures["batch_requests"] += int(values[REQUESTS])


def model_report(model: ModelCosts, rows: list[tuple[Row, list[float]]], since: float, seconds: float,
                 bucket_seconds: int) -> dict[str, Any]:
    owned = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "queue_seconds": 0.0}
    rented = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0, "estimated_requests": 0}
    batch = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "queue_seconds": 0.0}
    busy: dict[str, float] = {}
    held: dict[str, float] = {}
    per_bucket: dict[int, dict[str, float]] = {}
    for row, v in rows:
        slot = per_bucket.setdefault(row.bucket, {"requests": 0, "busy": 0.0, "owned_prompt": 0, "owned_completion": 0,
                                                  "rented_cost": 0.0})
        if not row.served:
            busy[row.backend] = busy.get(row.backend, 0.0) + v[BUSY]
            held[row.backend] = held.get(row.backend, 0.0) + v[HELD]
            slot["busy"] += v[BUSY]
            continue
        side = rented if row.served == "rented" else owned
        side["requests"] += int(v[REQUESTS])
        side["prompt_tokens"] += int(v[PROMPT])
        side["completion_tokens"] += int(v[COMPLETION])
        slot["requests"] += v[REQUESTS]
        if row.served == "rented":
            rented["cost"] += v[COST]
            rented["estimated_requests"] += int(v[ESTIMATED])
            slot["rented_cost"] += v[COST]
        else:
            owned["queue_seconds"] += v[QUEUE]
            slot["owned_prompt"] += v[PROMPT]
            slot["owned_completion"] += v[COMPLETION]
        if row.served == "batch":
            batch["requests"] += int(v[REQUESTS])
            batch["prompt_tokens"] += int(v[PROMPT])
            batch["completion_tokens"] += int(v[COMPLETION])
            batch["queue_seconds"] += v[QUEUE]

    hourly = [b.per_hour for b in model.backends if b.per_hour is not None]
    owned_cost = sum(hourly) * seconds / 3600 if hourly else None
    backends = []
    for b in model.backends:
        average = held.get(b.name, 0.0) / seconds
        backends.append({
            "name": b.name, "cost_per_hour": b.per_hour, "cap": b.cap,
            "utilisation": _round(min(1.0, busy.get(b.name, 0.0) / seconds)),
            "average_in_flight": _round(average, 4),
            "in_flight_vs_cap": _round(average / b.cap, 4) if b.cap else None,
        })
    # A model whose replicas are discovered lists none in the policy: no owned capacity to measure (and, with no
    # cost.per_hour either, its verdict is "unknown").
    utilisation = sum(min(seconds, busy.get(b.name, 0.0)) for b in model.backends) / (seconds * len(model.backends)) \
        if model.backends else 0.0
    capped = [b for b in model.backends if b.cap]
    batch_fill = sum(held.get(b.name, 0.0) for b in capped) / (seconds * sum(b.cap or 0 for b in capped)) if capped \
        else None
    owned_tokens = owned["prompt_tokens"] + owned["completion_tokens"]
    price = model.rented
    owned_at_rented = None if price is None else \
        (owned["prompt_tokens"] * price.input + owned["completion_tokens"] * price.output) / 1e6
    rent_all = None if owned_at_rented is None else owned_at_rented + rented["cost"]
    all_tokens = owned_tokens + rented["prompt_tokens"] + rented["completion_tokens"]
    own_all = owned_cost * all_tokens / owned_tokens if owned_cost is not None and owned_tokens else None
    per_million = owned_cost / owned_tokens * 1e6 if owned_cost is not None and owned_tokens else None
    rented_per_million = owned_at_rented / owned_tokens * 1e6 if owned_at_rented is not None and owned_tokens \
        else None
    break_even = utilisation * owned_cost / owned_at_rented if owned_cost is not None and owned_at_rented else None
    burst = burstiness([s["requests"] for s in per_bucket.values()], seconds, bucket_seconds)
    figures: dict[str, Any] = {
        "utilisation": _round(utilisation),
        "batch_fill": _round(batch_fill),
        "backends": backends,
        "owned": {**owned, "queue_seconds": _round(owned["queue_seconds"], 3)},
        "batch": {**batch, "queue_seconds": _round(batch["queue_seconds"], 3)},
        "rented": {**rented, "cost": _round(rented["cost"], 9), "provider": price.provider if price else None},
        "owned_cost": _round(owned_cost),
        "owned_cost_per_million_tokens": _round(per_million),
        "owned_tokens_at_rented_price": _round(owned_at_rented),
        "rented_price_per_million_tokens": _round(rented_per_million),
        "rent_all_cost": _round(rent_all),
        "actual_cost": _round(None if owned_cost is None else owned_cost + rented["cost"]),
        "own_all_cost": _round(own_all),
        "break_even_utilisation": _round(break_even),
        "burstiness": _round(burst, 3),
        "peak_requests_per_minute": _round(max((s["requests"] for s in per_bucket.values()), default=0)
                                           * 60 / bucket_seconds, 3),
    }
    figures["recommendation"] = recommend(figures, all_tokens)
    figures["series"] = series(per_bucket, model, price, since, seconds, bucket_seconds)
    return figures


def burstiness(requests_per_bucket: list[float], seconds: float, bucket_seconds: int) -> float | None:
    """Peak-to-mean of the request rate; empty buckets count in the mean (they are the valleys)."""
    total = sum(requests_per_bucket)
    if not total:
        return None
    mean = total / max(1.0, seconds / bucket_seconds)
    return max(requests_per_bucket) / mean


def recommend(f: dict[str, Any], tokens: float) -> dict[str, str]:
    """The cheapest of what was paid (owned + rented overflow), renting everything, and owning enough for
    everything (`own_all_cost`, an estimate at the measured utilisation); the reason names the figures."""
    owned, paid, rent_all, own_all = f["owned_cost"], f["actual_cost"], f["rent_all_cost"], f["own_all_cost"]
    util, burst = f["utilisation"], f["burstiness"] or 0.0
    fill = f", on average {f['batch_fill']:.0%} of the cap in flight" if f["batch_fill"] is not None else ""
    overflow = f["rented"]["cost"]
    numbers = (f"utilisation {util:.1%}{fill}, peak/mean {burst:.1f}; paid {_money(paid)} (owned {_money(owned)}"
               f" + rented overflow {_money(overflow)}) vs renting everything {_money(rent_all)}"
               f" vs owning enough for everything about {_money(own_all)}")
    if owned is None:
        return {"verdict": "unknown", "reason": "no backend of this model declares cost.per_hour"}
    if rent_all is None:
        return {"verdict": "own", "reason": f"no rented price to compare with (no provider for this model), so it "
                                            f"stays owned; {numbers}"}
    if not tokens:
        return {"verdict": "rent", "reason": f"no traffic in the window: the owned replicas cost {_money(owned)} "
                                             "doing nothing; scale them down or rent"}
    if rent_all < paid and (own_all is None or rent_all < own_all):
        return _rent(f, util, burst, numbers)
    # Owning more is estimated at the measured utilisation: bursts would leave the added capacity idler, so the
    # estimate only decides for steady traffic.
    if own_all is not None and own_all < paid and burst < BURSTY:
        return {"verdict": "own", "reason": f"steady traffic: owning enough for the overflow too was estimated "
                                            f"cheapest (at the measured utilisation); {numbers}"}
    if f["rented"]["requests"]:
        return {"verdict": "own the base, rent the bursts",
                "reason": f"owning the base and renting the overflow was cheapest (peaks {burst:.1f}x the mean); "
                          f"{numbers}"}
    return {"verdict": "own", "reason": f"owning was cheaper than renting everything; {numbers}"}


def _rent(f: dict[str, Any], util: float, burst: float, numbers: str) -> dict[str, str]:
    break_even = f["break_even_utilisation"]
    if break_even is None:
        above = ""
    elif break_even <= 1:
        above = f"; owning pays off above {break_even:.2%} utilisation"
    else:  # more tokens per busy hour (more requests served at once) or a cheaper GPU would have to change the sums
        above = (f"; even busy all the time with as many requests at once as now, owning would not pay off (it would"
                 f" take {break_even:.0%} utilisation): it pays off only with more requests served at once per GPU"
                 " or with cheaper GPUs")
    if burst >= BURSTY or util < HIGH_UTILISATION:
        return {"verdict": "rent", "reason": f"the GPUs were idle most of the time or the traffic came in bursts: "
                                             f"renting everything would have been cheapest; {numbers}{above}"}
    return {"verdict": "rent, or fill the GPUs", "reason": f"steady but too little traffic for the owned "
                                                          f"replicas: renting everything would have been "
                                                          f"cheapest; {numbers}{above}"}


def _money(value: float | None) -> str:
    return "?" if value is None else f"{value:.4g}"


def series(per_bucket: dict[int, dict[str, float]], model: ModelCosts, price: Prices | None, since: float,
           seconds: float, bucket_seconds: int) -> list[dict[str, Any]]:
    """Over the window, at most MAX_POINTS points (each one bucket, or as many whole buckets as keep a long
    window under that, so a 90-day report stays a few hundred kilobytes): utilisation, owned cost, rented
    cost, and what renting it all would have cost. A point the window cuts (the current bucket, when the
    window ends now) counts only its part in the window, so the owned costs add up to the window's and its
    utilisation is of the time that has passed. `seconds`: from `t` to the point's end."""
    hourly = sum(b.per_hour for b in model.backends if b.per_hour is not None)
    first = int(since // bucket_seconds) * bucket_seconds
    until = since + seconds
    step = max(1, math.ceil((until - first) / bucket_seconds / MAX_POINTS)) * bucket_seconds
    points: dict[int, dict[str, float]] = {}
    for bucket, slot in per_bucket.items():
        point = points.setdefault(first + (bucket - first) // step * step, dict.fromkeys(slot, 0.0))
        for field, value in slot.items():
            point[field] += value
    out = []
    for start in range(first, math.ceil(until), step):
        end = min(start + step, until)
        width = max(1e-9, end - max(start, since))
        s = points.get(start, {"requests": 0, "busy": 0.0, "owned_prompt": 0, "owned_completion": 0,
                               "rented_cost": 0.0})
        owned_at_rented = None if price is None else \
            (s["owned_prompt"] * price.input + s["owned_completion"] * price.output) / 1e6
        out.append({
            "t": start,
            "seconds": round(end - start, 3),
            "requests": int(s["requests"]),
            "utilisation": _round(min(1.0, s["busy"] / (width * max(1, len(model.backends)))), 4),
            "owned_cost": _round(hourly * width / 3600),
            "rented_cost": _round(s["rented_cost"], 9),
            "rent_all_cost": _round(None if owned_at_rented is None else owned_at_rented + s["rented_cost"], 9),
        })
    return out


def costs_of(policy: Policy, discovered: dict[str, set[str]] | None = None) -> list[ModelCosts]:
    """What the policy file says each model's backends cost and which rented price they compare with;
    `discovered`: the LoRA adapters found on each model's replicas (`lora.discover`) beside those it declares."""
    providers = {p.name: p for p in policy.providers}
    kwh = policy.ledger.power_price_per_kwh or 0.0
    out = []
    for model in policy.models:
        backends = [
            BackendCost(backend_name(model, i),
                        None if b.cost is None else b.cost.per_hour + (b.cost.power_kw or 0.0) * kwh, b.cap)
            for i, b in enumerate(model.backends)
        ]
        provider = providers.get(model.compared_provider() or "")
        price = None if provider is None else Prices(provider.price_per_million_tokens.input,
                                                     provider.price_per_million_tokens.output, provider.name)
        out.append(ModelCosts(model.name, backends, price))
        # a LoRA adapter: its own requests and tokens, compared with its base's rented price; the replicas (and
        # their cost and busy time) are its base's
        declared = [a.name for a in (model.lora.adapters if model.lora is not None else ())]
        found = sorted((discovered or {}).get(model.name, set()) - set(declared))
        out.extend(ModelCosts(name, [], price) for name in (*declared, *found))
    return out
