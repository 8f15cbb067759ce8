#!/usr/bin/env python3
"""Tables and checks from what the GPU run brought back (results/gpu/ at the repository's root): the knee sweeps and
the overload runs.

    python tests/benchmarks/gpu/summarize.py [RESULTS_DIR]

Prints markdown tables (as docs/benchmarks.md quotes them) and the issue's checks, each PASS or MISS with its
figures: through the gateway at 2x and 4x the cap, throughput >= 95% of the peak (the best direct level) and
backend TTFT p99 <= 1.5x the direct at-cap value, no failure except clean 429s; every knee level's achieved
in-flight mean within 10% of the level. Exit status 1 when a check misses.
"""
from __future__ import annotations

import glob
import json
import os
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def knee_table(report, label):
    rows = [f"**{label}**: recommended cap {report['knee']['recommended']} ({report['knee']['reason']})", "",
            "| level | held (client mean) | vLLM running + waiting | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | errors |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in report["levels"]:
        rw = None if lv["running_mean"] is None else lv["running_mean"] + (lv["waiting_mean"] or 0)
        rows.append("| {} | {} | {} | {:,.0f} | {} | {} | {} | {} |".format(
            lv["concurrency"], _f(lv["in_flight_mean"]), _f(rw), lv["output_tokens_per_s"], _ms(lv["ttft_p50_s"]),
            _ms(lv["ttft_p99_s"]), _ms(lv["tpot_p50_s"]), lv["errors"]))
    return "\n".join(rows)


def _f(x):
    return "—" if x is None else f"{x:.1f}"


def _ms(x):
    return "—" if x is None else f"{1000 * x:.0f}"


def overload_table(runs):
    rows = ["| run | streams | out tok/s | vs peak | TTFT p99 ms (client) | backend TTFT p99 ms | queue wait p99 ms "
            "| vLLM running mean | vLLM waiting max | errors | 429s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    peak = max(r["out_tok_per_s"] for r in runs["direct"]["rows"])
    for name, data in runs.items():
        for r in data["rows"]:
            rows.append("| {} | {} | {:,.0f} | {:.1%} | {} | {} | {} | {} | {} | {} | {} |".format(
                name, r["concurrency"], r["out_tok_per_s"], r["out_tok_per_s"] / peak, r["ttft_p99_ms"],
                r["backend_ttft_p99_ms"], r["queue_wait_p99_ms"], r["running_mean"], r["waiting_max"], r["errors"],
                r.get("refused_429", 0)))
    return "\n".join(rows)


def checks(knees, runs, cap):
    out = []
    for label, report in knees.items():
        for lv in report["levels"]:
            held = lv["in_flight_mean"]
            ok = held is not None and abs(held - lv["concurrency"]) <= 0.1 * lv["concurrency"]
            if not ok or lv["concurrency"] == max(x["concurrency"] for x in report["levels"]):
                out.append((ok, f"knee {label} c={lv['concurrency']}: client held {_f(held)} in flight"))
    if runs:
        direct = {r["concurrency"]: r for r in runs["direct"]["rows"]}
        peak = max(r["out_tok_per_s"] for r in direct.values())
        at_cap = direct.get(cap)
        for name in [n for n in runs if n != "direct"]:
            for r in runs[name]["rows"]:
                if r["concurrency"] < 2 * cap:
                    continue
                share = r["out_tok_per_s"] / peak
                out.append((share >= 0.95, f"{name} x{r['concurrency'] // cap}: {r['out_tok_per_s']:,.0f} tok/s = "
                                           f"{share:.1%} of the peak {peak:,.0f}"))
                if at_cap and r["backend_ttft_p99_ms"] is not None:
                    ratio = r["backend_ttft_p99_ms"] / at_cap["ttft_p99_ms"]
                    out.append((ratio <= 1.5, f"{name} x{r['concurrency'] // cap}: backend TTFT p99 "
                                              f"{r['backend_ttft_p99_ms']} ms = {ratio:.2f}x the at-cap "
                                              f"{at_cap['ttft_p99_ms']} ms"))
                out.append((r["errors"] == 0, f"{name} x{r['concurrency'] // cap}: {r['errors']} failed, "
                                              f"{r.get('refused_429', 0)} clean 429s"))
    return out


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "..", "results", "gpu")
    knees = {os.path.basename(os.path.dirname(p)).removeprefix("knee-"): load(p)
             for p in sorted(glob.glob(os.path.join(root, "knee-*", "knee-*.json")))
             if "compare" not in os.path.basename(p)}
    runs = {}
    for name, fn in (("direct", "overload-direct.json"), ("gateway", "overload-gateway.json"),
                     ("3 gateways, one Redis", "overload-gateway3.json")):
        if os.path.exists(os.path.join(root, fn)):
            runs[name] = load(os.path.join(root, fn))
    for label, report in knees.items():
        print(knee_table(report, label), end="\n\n")
    # the cap the overload ran at: the BF16 knee's, or (a repeat of the overload alone) its lowest level
    cap = knees["bf16"]["knee"]["recommended"] if "bf16" in knees else (
        min(r["concurrency"] for r in runs["direct"]["rows"]) if "direct" in runs else None)
    if "direct" in runs:
        print(overload_table(runs), end="\n\n")
    results = checks(knees, runs if "direct" in runs else {}, cap)
    for ok, text in results:
        print(("PASS " if ok else "MISS ") + text)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
