"""The ledger's arithmetic: busy time as a union of intervals split over buckets, the report's figures and
recommendation, budget periods, and the policy fields that feed them."""

import datetime
import random

import pytest

from gateway.cli.report import chart_lines
from policies.budget import period_bounds
from policies.config import PolicyError, parse_policy
from policies.ledger.report import BackendCost, ModelCosts, Prices, build_report, burstiness, costs_of
from policies.ledger.sums import BUSY, COUNTERS, HELD, Batch, Row, Sums


def totals(rows: dict, index: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for row, values in rows.items():
        if not row.served:
            out[row.bucket] = out.get(row.bucket, 0.0) + values[index]
    return out


def test_busy_time_is_the_union_of_intervals_across_buckets_and_flushes():
    sums = Sums(10)
    flushed: list[dict] = []
    # intervals as (start, end), reported in order of end, as calls finish
    calls = [(1, 4), (3, 12), (2, 15), (30, 31), (25, 33), (40, 41)]
    for i, (start, end) in enumerate(calls):
        sums.in_flight("m", "b", start, end)
        if i in (1, 3):  # a flush between calls: later calls only add what no earlier one covered
            flushed.append(sums.take().rows)
    flushed.append(sums.take().rows)
    busy: dict[int, float] = {}
    held: dict[int, float] = {}
    for rows in flushed:
        for bucket, value in totals(rows, BUSY).items():
            busy[bucket] = busy.get(bucket, 0.0) + value
        for bucket, value in totals(rows, HELD).items():
            held[bucket] = held.get(bucket, 0.0) + value
    # union: [1, 15] and [25, 33] and [40, 41] -> per 10 s bucket: 0: 9, 10: 5, 20: 5, 30: 3, 40: 1
    assert busy == pytest.approx({0: 9, 10: 5, 20: 5, 30: 3, 40: 1})
    assert sum(held.values()) == pytest.approx(sum(b - a for a, b in calls))


def test_busy_time_matches_a_brute_force_union():
    rng = random.Random(7)
    calls = []
    for _ in range(300):
        start = rng.uniform(0, 500)
        calls.append((start, start + rng.expovariate(1 / 3)))
    calls.sort(key=lambda c: c[1])
    sums = Sums(60)
    for start, end in calls:
        sums.in_flight("m", "b", start, end)
    covered = sum(1 for t in range(0, 600 * 100) if any(a <= t / 100 < b for a, b in calls)) / 100
    batch = sums.take()
    assert sum(totals(batch.rows, BUSY).values()) == pytest.approx(covered, abs=0.5)
    # the intervals kept for a shared store's union add up to the same, each inside its bucket
    pieces = [(bucket, a, b) for (bucket, _, _), spans in batch.busy.items() for a, b in spans]
    assert sum(b - a for _, a, b in pieces) == pytest.approx(sum(totals(batch.rows, BUSY).values()))
    assert all(bucket <= a < b <= bucket + 60 for bucket, a, b in pieces)


def test_put_back_is_bounded():
    sums = Sums(60)
    sums.call(5, "m", "b", "k", False, 10, 20, 0.5, 0.0)
    sums.in_flight("m", "b", 1, 2)
    batch = sums.take()
    assert sums.put_back(batch, limit=10) and sums.take().rows[Row(0, "m", "b", "k", "owned")][:3] == [1, 10, 20]
    assert not sums.put_back(Batch({Row(60 * i, "m", "b", "k", "owned"): [0.0] * len(COUNTERS) for i in range(20)},
                                   {}), 10)
    assert not sums.put_back(Batch({}, {(0, "m", "b"): [(i, i + 0.5) for i in range(11)]}), 10)  # intervals count


def row(bucket, served, requests=0, prompt=0, completion=0, cost=0.0, busy=0.0, held=0.0, key="k", estimated=0):
    return (Row(bucket, "m", "gpu" if served != "rented" else "rented:p", "" if not served else key, served),
            [requests, prompt, completion, 0.0, cost, busy, held, estimated])


MODEL = ModelCosts("m", [BackendCost("gpu", 3.6, 8)], Prices(1.0, 2.0, "p"))


def test_report_figures_for_a_steady_busy_hour():
    rows = [row(b, "owned", requests=60, prompt=60_000, completion=60_000) for b in range(0, 3600, 60)]
    rows += [row(b, "", busy=54.0, held=240.0) for b in range(0, 3600, 60)]
    m = build_report(rows, [MODEL], 0, 3600, 60)["models"]["m"]
    tokens = 60 * 120_000
    assert m["utilisation"] == pytest.approx(0.9)
    assert m["owned_cost"] == pytest.approx(3.6)
    assert m["owned_cost_per_million_tokens"] == pytest.approx(3.6 / tokens * 1e6)
    assert m["owned_tokens_at_rented_price"] == pytest.approx((60 * 60_000 * 1 + 60 * 60_000 * 2) / 1e6)
    assert m["backends"][0]["average_in_flight"] == pytest.approx(4.0)
    assert m["backends"][0]["in_flight_vs_cap"] == pytest.approx(0.5)
    assert m["burstiness"] == pytest.approx(1.0)
    assert m["recommendation"]["verdict"] == "own"  # 3.6 owned against 10.8 rented
    assert len(m["series"]) == 60 and m["series"][0]["utilisation"] == pytest.approx(0.9)


def test_report_recommends_renting_bursty_idle_traffic_and_names_the_break_even():
    rows = [row(600, "owned", requests=30, prompt=3000, completion=3000), row(600, "", busy=30.0, held=30.0),
            row(600, "rented", requests=10, prompt=1000, completion=1000, cost=0.003)]
    m = build_report(rows, [MODEL], 0, 3600, 60)["models"]["m"]
    assert m["burstiness"] == pytest.approx(40 / (40 / 60))  # all in one minute of sixty
    assert m["rent_all_cost"] == pytest.approx(0.009 + 0.003)
    assert m["recommendation"]["verdict"] == "rent"
    assert m["break_even_utilisation"] == pytest.approx(30 / 3600 * 3.6 / 0.009)
    assert "%" in m["recommendation"]["reason"]


def test_report_without_a_price_or_traffic():
    unpriced = ModelCosts("m", [BackendCost("gpu", None, None)], None)
    assert build_report([], [unpriced], 0, 60, 60)["models"]["m"]["recommendation"]["verdict"] == "unknown"
    discovered = build_report([], [ModelCosts("m", [], Prices(1.0, 2.0, "p"))], 0, 60, 60)["models"]["m"]
    assert discovered["utilisation"] == 0 and discovered["recommendation"]["verdict"] == "unknown"
    assert discovered["series"][0]["utilisation"] == 0  # a model whose replicas come from discovery lists none
    private = ModelCosts("m", [BackendCost("gpu", 1.0, None)], None)
    assert build_report([], [private], 0, 60, 60)["models"]["m"]["recommendation"]["verdict"] == "own"
    idle = build_report([], [MODEL], 0, 3600, 60)["models"]["m"]
    assert idle["recommendation"]["verdict"] == "rent" and "no traffic" in idle["recommendation"]["reason"]
    assert burstiness([], 60, 60) is None


def test_a_window_that_ends_inside_a_bucket_counts_only_its_part():
    """Until "now" the last bucket is still running: its owned cost and utilisation are of the time passed."""
    rows = [row(0, "", busy=30.0, held=30.0), row(60, "", busy=15.0, held=15.0),
            row(60, "owned", requests=1, prompt=1000, completion=1000)]
    report = build_report(rows, [MODEL], 0, 90, 60)
    m = report["models"]["m"]
    assert m["owned_cost"] == pytest.approx(3.6 * 90 / 3600)
    assert sum(p["owned_cost"] for p in m["series"]) == pytest.approx(m["owned_cost"])
    assert [p["utilisation"] for p in m["series"]] == pytest.approx([0.5, 0.5])  # 15 s busy of the 30 s passed

    # the chart's lines reach the window's end: the last bucket drawn as wide as it is, the costs' totals
    lines = chart_lines(report, m)
    assert [t.timestamp() for t in lines["edges"]] == [0, 60, 90]
    assert lines["utilisation"] == pytest.approx([50, 50, 50])
    assert lines["owned_cost"][0] == 0 and lines["owned_cost"][-1] == pytest.approx(m["owned_cost"])
    assert lines["rent_all_cost"][-1] == pytest.approx(m["rent_all_cost"]) == pytest.approx(0.003)


def test_a_long_window_keeps_its_series_short_and_its_sums():
    """90 days of one-minute buckets (the longest window the API takes): 1440 points of 90 minutes, not
    129,600 (tens of megabytes of JSON, seconds of the event loop), with nothing lost in the merge."""
    days = 90
    rows = [row(86400 * 30 + 60 * i, "owned", requests=1, prompt=10, completion=10) for i in range(3)]
    rows += [row(86400 * 30, "", busy=60.0, held=60.0), row(86400 * 30 + 60, "", busy=30.0, held=30.0)]
    m = build_report(rows, [MODEL], 0, days * 86400, 60)["models"]["m"]
    assert len(m["series"]) == 1440 and {p["seconds"] for p in m["series"]} == {days * 60}
    assert sum(p["owned_cost"] for p in m["series"]) == pytest.approx(m["owned_cost"]) == pytest.approx(3.6 * 24 * days)
    (busy,) = [p for p in m["series"] if p["requests"]]
    assert busy["t"] == 86400 * 30 and busy["requests"] == 3
    assert busy["utilisation"] == pytest.approx(90 / 5400, abs=1e-4)


@pytest.mark.parametrize("period, now, start, end", [
    ("day", "2026-03-15T13:00:00", "2026-03-15T00:00:00", "2026-03-16T00:00:00"),
    ("week", "2026-03-15T13:00:00", "2026-03-09T00:00:00", "2026-03-16T00:00:00"),  # a Sunday: Monday's week
    ("month", "2026-12-31T23:59:59", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
])
def test_budget_periods_are_utc_calendar_periods(period, now, start, end):
    def ts(text):
        return datetime.datetime.fromisoformat(text).replace(tzinfo=datetime.timezone.utc).timestamp()

    assert period_bounds(period, ts(now)) == (ts(start), ts(end))


POLICY = """
ledger: {power_price_per_kwh: 0.3}
providers:
  - {name: cloud, base_url: "https://api.example.com/v1", api_key_env: CLOUD_KEY, models: {m: big},
     price_per_million_tokens: {input: 1, output: 4}}
models:
  - name: m
    overflow: {provider: cloud}
    backends: [{url: "http://10.0.0.1:8000", cost: {per_hour: 2.5, power_kw: 1.0}}, {url: "http://10.0.0.2:8000"}]
"""


def test_policy_costs_and_their_errors():
    costs = costs_of(parse_policy(POLICY))
    assert costs[0].backends[0].per_hour == pytest.approx(2.8) and costs[0].backends[1].per_hour is None
    assert costs[0].rented == Prices(1.0, 4.0, "cloud")
    for text, expected in [
        (POLICY.replace("power_price_per_kwh: 0.3", "bucket_seconds: 60"),
         "models[0](name=m).backends[0].cost.power_kw: needs ledger.power_price_per_kwh"),
        (POLICY.replace("per_hour: 2.5", "per_hour: -1"), "cost.per_hour"),
        (POLICY.replace("cost: {per_hour: 2.5,", "cost: {"), "cost.per_hour: required field is missing"),
        (POLICY.replace("overflow: {provider: cloud}", "rented_price_from: nope"),
         "models[0](name=m).rented_price_from: provider 'nope' is not declared"),
        (POLICY.replace("{power_price_per_kwh: 0.3}", "{bucket_seconds: 0}"), "ledger.bucket_seconds"),
    ]:
        with pytest.raises(PolicyError) as info:
            parse_policy(text, "p.yaml")
        assert expected in str(info.value)


# The known workload of an hour, by hand: prices 1.0 in / 2.0 out per million tokens. Owned: 4.2 an hour;
# 1.277M prompt + 1.0M completion tokens = 3.277 at the rented price; busy 108 s of 3600 = 3.0%. Rented overflow:
# 0.4M + 1.0M tokens that cost 2.4. Paid 4.2 + 2.4 = 6.6; renting everything 3.277 + 2.4 = 5.677; owning enough
# for everything about 4.2 x 3.677M / 2.277M = 6.7823; break-even 0.03 x 4.2 / 3.277 = 3.845%.
KNOWN = ModelCosts("m", [BackendCost("gpu", 4.2, 8)], Prices(1.0, 2.0, "p"))


def test_known_workload_paid_more_than_renting_everything_is_not_called_cheaper_to_own():
    rows = [row(600, "owned", requests=100, prompt=1_277_000, completion=1_000_000), row(600, "", busy=108.0),
            row(600, "rented", requests=50, prompt=400_000, completion=1_000_000, cost=2.4)]
    m = build_report(rows, [KNOWN], 0, 3600, 60)["models"]["m"]
    assert m["owned_cost"] == pytest.approx(4.2) and m["owned_tokens_at_rented_price"] == pytest.approx(3.277)
    assert m["actual_cost"] == pytest.approx(6.6) and m["rent_all_cost"] == pytest.approx(5.677)
    assert m["own_all_cost"] == pytest.approx(4.2 * 3_677_000 / 2_277_000)
    assert m["utilisation"] == pytest.approx(0.03) and m["break_even_utilisation"] == pytest.approx(0.0384498, 1e-4)
    verdict, reason = m["recommendation"]["verdict"], m["recommendation"]["reason"]
    assert verdict == "rent" and "cheaper to own" not in reason and "owning was cheaper" not in reason
    for figure in ("paid 6.6", "owned 4.2", "overflow 2.4", "renting everything 5.677", "about 6.782", "3.0%",
                   "3.84%"):
        assert figure in reason, (figure, reason)


def test_steady_busy_traffic_dearer_than_renting_everything_reads_rent_or_fill():
    # 60 minutes, 2 x 30k tokens each at 1.0 + 2.0: renting the owned tokens 5.4 < owned 7.2; busy 60%.
    rows = [row(b, "owned", requests=10, prompt=30_000, completion=30_000) for b in range(0, 3600, 60)]
    rows += [row(b, "", busy=36.0) for b in range(0, 3600, 60)]
    m = build_report(rows, [ModelCosts("m", [BackendCost("gpu", 7.2, 8)], MODEL.rented)], 0, 3600, 60)["models"]["m"]
    assert m["actual_cost"] == pytest.approx(7.2) and m["rent_all_cost"] == pytest.approx(5.4)
    assert m["own_all_cost"] == pytest.approx(7.2)
    assert m["recommendation"]["verdict"] == "rent, or fill the GPUs"
    assert "paid 7.2" in m["recommendation"]["reason"] and "renting everything 5.4" in m["recommendation"]["reason"]


def test_bursty_overflow_cheaper_than_renting_everything_reads_own_the_base():
    # Owned 3.6 for 60 x 120k tokens = 10.8 at the rented price; a burst of 200k tokens rented for 0.5 in one
    # minute. Paid 4.1 < renting everything 11.3; owning for it too about 3.6 x 7.4M / 7.2M = 3.7, but only at
    # the measured utilisation, which a burst would not keep: bursty, so the base stays owned and bursts rented.
    rows = [row(b, "owned", requests=60, prompt=60_000, completion=60_000) for b in range(0, 3600, 60)]
    rows += [row(b, "", busy=54.0) for b in range(0, 3600, 60)]
    rows.append(row(1200, "rented", requests=600, prompt=100_000, completion=100_000, cost=0.5))
    m = build_report(rows, [MODEL], 0, 3600, 60)["models"]["m"]
    assert m["actual_cost"] == pytest.approx(4.1) and m["rent_all_cost"] == pytest.approx(11.3)
    assert m["own_all_cost"] == pytest.approx(3.7) and m["burstiness"] >= 3
    assert m["recommendation"]["verdict"] == "own the base, rent the bursts"
    assert "paid 4.1" in m["recommendation"]["reason"] and "11.3" in m["recommendation"]["reason"]


def test_steady_overflow_dearer_than_owning_more_reads_own():
    # Owned 3.6 for 7.2M tokens (10.8 at the rented price); 10 requests a minute of steady overflow, 60 x 12k
    # tokens that cost 1.2 in all. Paid 4.8; renting everything 12.0; owning for it too about
    # 3.6 x 7.92M / 7.2M = 3.96: the cheapest, so own enough for everything.
    rows = [row(b, "owned", requests=60, prompt=60_000, completion=60_000) for b in range(0, 3600, 60)]
    rows += [row(b, "", busy=54.0) for b in range(0, 3600, 60)]
    rows += [row(b, "rented", requests=10, prompt=6_000, completion=6_000, cost=0.02) for b in range(0, 3600, 60)]
    m = build_report(rows, [MODEL], 0, 3600, 60)["models"]["m"]
    assert m["actual_cost"] == pytest.approx(4.8) and m["rent_all_cost"] == pytest.approx(12.0)
    assert m["own_all_cost"] == pytest.approx(3.96)
    assert m["recommendation"]["verdict"] == "own"
    assert "paid 4.8" in m["recommendation"]["reason"] and "about 3.96" in m["recommendation"]["reason"]


def test_the_report_says_how_many_rented_calls_were_charged_an_estimate_in_json_and_text():
    from gateway.cli.report import render

    rows = [row(0, "owned", requests=10, prompt=1000, completion=1000), row(0, "", busy=30.0, held=30.0),
            row(0, "rented", requests=7, prompt=700, completion=70, cost=0.84, estimated=3),
            row(60, "rented", requests=2, prompt=200, completion=20, cost=0.24, estimated=1, key="other")]
    report = build_report(rows, [MODEL], 0, 120, 60)
    rented = report["models"]["m"]["rented"]
    assert rented["requests"] == 9 and rented["estimated_requests"] == 4
    assert "  rented: 9 requests, 4 of them charged the gateway's estimate (the provider sent no usage)" in \
        render(report).splitlines()
