"""What a sweep leaves behind: a JSON record, a PNG plot and a table for the terminal.

The plot and the table are drawn from the JSON record alone, so a record can be re-plotted or compared
later without the backend.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .analysis import Knee, Point, find_knee
from .sweep import LevelResult, SweepResult


def points(levels: list[LevelResult] | list[dict[str, Any]]) -> list[Point]:
    rows = [asdict(r) if isinstance(r, LevelResult) else r for r in levels]
    return [Point(r["concurrency"], r["output_tokens_per_s"], r["ttft_p99_s"], r["errors"], r.get("waiting_mean"))
            for r in rows]


def build_report(result: SweepResult, slo_ttft_p99: float | None = None) -> dict[str, Any]:
    knee: Knee = find_knee(points(result.levels), slo_ttft_p99)
    return {
        "kind": "llm-gateway knee sweep",
        "version": 1,
        "started_at": _iso(result.started_at),
        "finished_at": _iso(result.finished_at),
        "inputs": {**result.spec.public(), "slo_ttft_p99_s": slo_ttft_p99, "prompt_words": result.prompt_words},
        "levels": [asdict(r) for r in result.levels],
        "stopped": result.stopped,
        "knee": knee.to_dict(),
        "warnings": concurrency_warnings(result.levels),
    }


HELD = 0.10  # the client's or vLLM's mean concurrency may stray this far from the level before a warning


def concurrency_warnings(levels: list[LevelResult]) -> list[str]:
    """Levels whose concurrency was not what was asked: the client did not keep it in flight, or vLLM did not
    see it (running + waiting). Either way that level measured something else than its label says."""
    out = []
    for r in levels:
        c = r.concurrency
        if r.in_flight_mean is not None and abs(r.in_flight_mean - c) > HELD * c:
            out.append(f"c={c}: the client held {r.in_flight_mean:.1f} requests in flight on average, not {c} "
                       f"({r.processes} client process{'es' if r.processes > 1 else ''}): this level's figures "
                       "are the client's limit, not the server's")
        if r.running_mean is not None:
            seen = r.running_mean + (r.waiting_mean or 0.0)
            if abs(seen - c) > HELD * c:
                out.append(f"c={c}: vLLM saw {seen:.1f} requests (running + waiting, mean) where {c} were sent")
    return out


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def file_stem(model: str, when: float) -> str:
    """knee-<model>-<UTC timestamp>, with anything unsafe in a file name (e.g. the / of Qwen/Qwen3-4B) as _."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._") or "model"
    return f"knee-{safe}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(when))}"


def write_json(report: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _g(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of every level, the recommended cap marked, and the verdict below it."""
    cap = report["knee"]["recommended"]
    head = ("c", "held", "tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "TPOT p50", "running", "waiting",
            "KV max", "errors", "")
    rows = [head, ("", "mean", "", "", "ms", "ms", "ms", "ms", "mean/max", "mean/max", "%", "", "")]
    for r in report["levels"]:
        rows.append((
            str(r["concurrency"]), _g(r.get("in_flight_mean")), f"{r['output_tokens_per_s']:.0f}",
            f"{r['requests_per_s']:.2f}", _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), _ms(r["itl_p50_s"]),
            _ms(r.get("tpot_p50_s")),
            f"{_g(r['running_mean'])}/{_g(r['running_max'], '{:g}')}",
            f"{_g(r['waiting_mean'])}/{_g(r['waiting_max'], '{:g}')}",
            _g(None if r["kv_cache_max"] is None else r["kv_cache_max"] * 100),
            str(r["errors"]), "<- cap" if r["concurrency"] == cap else "",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i < len(head) - 1 else cell for i, (cell, w) in enumerate(zip(row, widths)))
             .rstrip() for row in rows]
    knee = report["knee"]
    verdict = f"recommended cap: {cap}" if cap is not None else "no cap recommended"
    lines += ["", f"{verdict} ({knee['reason']})"]
    if report.get("stopped"):
        lines.append(f"note: {report['stopped']}")
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    short = [r for r in report["levels"] if not r.get("complete", True)]
    if short:
        lines.append("note: the time limit closed the window before enough requests completed at "
                     + ", ".join(f"c={r['concurrency']} ({r['requests']} completed)" for r in short))
    return "\n".join(lines)


def write_png(report: dict[str, Any], path: Path) -> None:
    """Throughput and TTFT p99 against concurrency (log2 x), the cap marked; vLLM's gauges below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    levels = report["levels"]
    inputs, knee = report["inputs"], report["knee"]
    cs = [r["concurrency"] for r in levels]
    tps = [r["output_tokens_per_s"] for r in levels]
    p99 = [None if r["ttft_p99_s"] is None else r["ttft_p99_s"] * 1000 for r in levels]
    p50 = [None if r["ttft_p50_s"] is None else r["ttft_p50_s"] * 1000 for r in levels]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1.2),
                                      layout="constrained")
    tp_color, lat_color, cap_color = "#1f5fa8", "#c0392b", "#1e8449"
    top.plot(cs, tps, "o-", color=tp_color, lw=2.2, ms=6, label="output tok/s", zorder=3)
    top.set_ylabel("output tokens / s", color=tp_color)
    top.tick_params(axis="y", colors=tp_color)
    top.set_ylim(0, max(tps + [1]) * 1.15)
    top.grid(True, which="major", alpha=0.3)
    lat = top.twinx()
    lat.plot(cs, _nan(p99), "s--", color=lat_color, lw=1.8, ms=5, label="TTFT p99")
    lat.plot(cs, _nan(p50), ":", color=lat_color, lw=1.2, alpha=0.6, label="TTFT p50")
    lat.set_ylabel("time to first token (ms)", color=lat_color)
    lat.tick_params(axis="y", colors=lat_color)
    lat.set_ylim(0, max([v for v in p99 if v is not None] + [1]) * 1.15)
    slo = inputs.get("slo_ttft_p99_s")
    if slo:
        lat.axhline(slo * 1000, color=lat_color, lw=1, alpha=0.5, ls="-.")
        lat.annotate(f"TTFT p99 SLO {slo * 1000:.0f} ms", (cs[0], slo * 1000), xytext=(2, 3),
                     textcoords="offset points", color=lat_color, fontsize=8,
                     bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})
    for r in levels:
        if r["errors"]:
            top.plot(r["concurrency"], r["output_tokens_per_s"], "X", color="black", ms=10, zorder=4)
            top.annotate(f"{r['errors']} errors", (r["concurrency"], r["output_tokens_per_s"]),
                         xytext=(6, -12), textcoords="offset points", fontsize=8)
    cap = knee["recommended"]
    if knee["knee"] is not None and knee["knee"] != cap:
        top.axvline(knee["knee"], color="grey", lw=1, ls="--")
        top.annotate("throughput knee", (knee["knee"], 0), xytext=(4, 4), textcoords="offset points",
                     color="grey", fontsize=8)
    if cap is not None:
        row = next(r for r in levels if r["concurrency"] == cap)
        top.axvline(cap, color=cap_color, lw=2, alpha=0.8)
        top.plot(cap, row["output_tokens_per_s"], "o", ms=14, mfc="none", mec=cap_color, mew=2, zorder=5)
        right_half = cs.index(cap) > (len(cs) - 1) / 2  # put the label on the side with room
        top.annotate(f"cap {cap}\n{row['output_tokens_per_s']:.0f} tok/s\nTTFT p99 {_ms(row['ttft_p99_s'])} ms",
                     (cap, row["output_tokens_per_s"]), xytext=(-12 if right_half else 12, -50),
                     textcoords="offset points", ha="right" if right_half else "left",
                     color=cap_color, fontsize=9, fontweight="bold",
                     bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "none", "alpha": 0.85})
    handles = top.get_legend_handles_labels()[0] + lat.get_legend_handles_labels()[0]
    top.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=9)
    verdict = f"recommended cap {cap}" if cap is not None else "no cap recommended"
    if cap is not None and knee["knee"] != cap:
        verdict += f" (throughput knee {knee['knee']}, bounded by the TTFT p99 SLO)"
    top.set_title(f"{inputs['model']}: {verdict}\n{inputs['prompt_tokens']} prompt / {inputs['output_tokens']} "
                  f"output tokens, closed loop, {_window(inputs)} per level", fontsize=11)

    run = [r["running_mean"] for r in levels]
    wait = [r["waiting_mean"] for r in levels]
    bottom.plot(cs, _nan(run), "o-", color=tp_color, lw=1.5, ms=4, label="running (mean)")
    bottom.plot(cs, _nan(wait), "o-", color="#e67e22", lw=1.5, ms=4, label="waiting (mean)")
    bottom.fill_between(cs, _nan(wait, 0), color="#e67e22", alpha=0.15)
    bottom.set_ylabel("requests in vLLM", fontsize=9)
    bottom.set_ylim(bottom=0)
    bottom.grid(True, alpha=0.3)
    kv = bottom.twinx()
    kv.plot(cs, _nan([None if r["kv_cache_max"] is None else r["kv_cache_max"] * 100 for r in levels]), "^:",
            color="grey", ms=4, label="KV cache (max %)")
    kv.set_ylim(0, 105)
    kv.set_ylabel("KV cache %", fontsize=9, color="grey")
    handles = bottom.get_legend_handles_labels()[0] + kv.get_legend_handles_labels()[0]
    bottom.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    if cap is not None:
        bottom.axvline(cap, color=cap_color, lw=2, alpha=0.8)
    bottom.set_xscale("log", base=2)
    bottom.xaxis.set_major_locator(FixedLocator(cs))
    bottom.xaxis.set_minor_locator(NullLocator())
    bottom.set_xticks(cs, [str(c) for c in cs])
    bottom.set_xlabel("concurrent requests (log2 scale)")
    fig.supxlabel(f"{knee['reason']}\n{inputs['url']}, {report['started_at']}", fontsize=7, color="grey",
                  wrap=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _nan(values: list[float | None], fill: float = float("nan")) -> list[float]:
    return [fill if v is None else v for v in values]


def _window(inputs: dict[str, Any]) -> str:
    if not inputs.get("duration"):
        return f"{inputs['requests']} requests"
    more = f" and at least {inputs['min_requests']} requests" if inputs.get("min_requests") else ""
    return f"{inputs['duration']:g} s{more}"
