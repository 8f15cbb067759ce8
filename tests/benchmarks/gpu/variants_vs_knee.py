#!/usr/bin/env python3
"""Step 6's check: the gateway's per-variant figures against `knee` of each variant's server at the same load.

usage: variants_vs_knee.py OUT [--tolerance 0.10]
Reads, under OUT (as step6.sh writes it):
  knee6-<variant>/knee-*.json   each server's own short knee (both swept at once, as they share the GPU then too)
  gw-<total>/variants.json      GET /admin/variants after <total> streams through one gateway, 50/50 over the
                                live variants (so each server met <total>/<variants> streams)
  gw-<total>/rates.json         each server's own output tok/s in that run's measured window (rates.py)
For each run and variant: TTFT p50 (the gateway's, queue excluded) against knee's TTFT p50, and the server's own
output tok/s against knee's; both within --tolerance pass. ITL p50 and per-stream tok/s are shown too. Knee's
figures are read at the load the server really held in the run (vLLM's running + waiting, mean over the window,
linearly between knee's levels): a split by weight gives each variant half the requests, not half the streams,
so the slower one holds more of them. Without that gauge, at <total>/<variants>.
Writes OUT/variants-vs-knee.json; exit 1 when a figure is outside the tolerance or missing.
"""
import argparse, glob, json, os, sys


def newest(pattern):
    files = sorted(glob.glob(pattern))
    return files[-1] if files else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out"); ap.add_argument("--tolerance", type=float, default=0.10)
    a = ap.parse_args()
    knees = {}
    for d in sorted(glob.glob(os.path.join(a.out, "knee6-*"))):
        f = newest(os.path.join(d, "knee-*.json"))
        if f:
            knees[os.path.basename(d)[len("knee6-"):]] = {r["concurrency"]: r for r in json.load(open(f))["levels"]}
    rows, checks = [], []
    runs = sorted(glob.glob(os.path.join(a.out, "gw-*")), key=lambda d: int(d.rsplit("-", 1)[1]))
    for run in runs:
        total = int(run.rsplit("-", 1)[1])
        try:
            models = json.load(open(os.path.join(run, "variants.json")))["models"]
            rates = json.load(open(os.path.join(run, "rates.json")))
        except (OSError, ValueError, KeyError) as exc:
            checks.append((f"gw-{total}: readable results ({exc})", False)); continue
        for model, signals in models.items():
            live = [v for v in signals["variants"] if not v["shadow"] and v["weight"] > 0]
            nominal = total // max(1, len(live))
            for v in live:
                r = rates.get(v["name"], {})
                level = r.get("held_mean") or nominal
                k = at(knees.get(v["name"], {}), level)
                row = {"run": total, "variant": v["name"], "level": level, "knee_range": k and k["range"],
                       "requests": v["requests"],
                       "errors": sum(v["errors"].values()),
                       "ttft_p50_ms": ms(v["ttft_p50"]), "knee_ttft_p50_ms": ms(k and k["ttft_p50_s"]),
                       "tok_s": r.get("output_tokens_per_s"), "knee_tok_s": k and round(k["output_tokens_per_s"], 1),
                       "itl_p50_ms": ms(v["itl_p50"]), "knee_itl_p50_ms": ms(k and k["itl_p50_s"]),
                       "stream_tok_s": v["tokens_per_second_p50"] and round(v["tokens_per_second_p50"], 1),
                       "knee_stream_tok_s": k and k.get("tpot_p50_s") and round(1 / k["tpot_p50_s"], 1),
                      }
                row["ttft_ratio"] = ratio(row["ttft_p50_ms"], row["knee_ttft_p50_ms"])
                row["tok_s_ratio"] = ratio(row["tok_s"], row["knee_tok_s"])
                rows.append(row)
                for what in ("ttft", "tok_s"):
                    x = row[f"{what}_ratio"]
                    checks.append((f"{model} {v['name']} holding {level} streams (gw-{total}): {what} "
                                   f"{'-' if x is None else f'{x:.3f}x'} knee's, within {a.tolerance:.0%}",
                                   x is not None and abs(x - 1) <= a.tolerance))
    if not rows:
        checks.append(("at least one gateway run with variants compared", False))
    cols = ["run", "variant", "level", "knee_range", "requests", "errors", "ttft_p50_ms", "knee_ttft_p50_ms",
            "ttft_ratio", "tok_s", "knee_tok_s", "tok_s_ratio", "itl_p50_ms", "knee_itl_p50_ms", "stream_tok_s",
            "knee_stream_tok_s"]
    table = [cols] + [["-" if row[c] is None else str(row[c]) for c in cols] for row in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths)))
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    json.dump({"rows": rows, "checks": checks, "tolerance": a.tolerance},
              open(os.path.join(a.out, "variants-vs-knee.json"), "w"), indent=1)
    return 0 if checks and all(ok for _, ok in checks) else 1


def at(levels, c):
    """Knee's figures at concurrency c: linear between the two levels around it; the nearest level outside
    the swept range ("range" says which: "in", "below", "above")."""
    if not levels:
        return None
    cs = sorted(levels)
    if c <= cs[0] or c >= cs[-1]:
        edge = cs[0] if c <= cs[0] else cs[-1]
        return {**levels[edge], "range": "in" if c == edge else ("below" if c < edge else "above")}
    hi = next(x for x in cs if x >= c)
    lo = max(x for x in cs if x <= c)
    if hi == lo:
        return {**levels[lo], "range": "in"}
    f = (c - lo) / (hi - lo)
    out = {"range": "in"}
    for key in ("ttft_p50_s", "output_tokens_per_s", "itl_p50_s", "tpot_p50_s"):
        a, b = levels[lo].get(key), levels[hi].get(key)
        out[key] = None if a is None or b is None else a + f * (b - a)
    return out


def ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)


def ratio(x, base):
    return None if x is None or not base else round(x / base, 3)


if __name__ == "__main__":
    sys.exit(main())
