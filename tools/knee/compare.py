"""Several sweeps side by side: one table and one plot (`llm-gateway knee --compare A.json B.json ...`).

The tuning loop is to change one server flag (FP8 weights, --max-num-seqs, a draft model), sweep again, and keep
the change only if the curve is better. Each sweep's JSON record holds everything needed, so comparing them needs
no backend: per sweep its recommended cap, the throughput and TTFT p99 there, its peak, and per level the
throughput (and its ratio to the first sweep's, the baseline), drawn as one throughput panel and one TTFT panel
on the same log2 concurrency axis, each sweep's cap marked in its colour.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

COLOURS = ("#1f5fa8", "#c0392b", "#1e8449", "#8e44ad", "#e67e22", "#16a085", "#7f8c8d", "#d35400")


class CompareError(Exception):
    """A file that is not a knee sweep record."""


def load(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CompareError(f"{path}: cannot read a sweep record ({exc})") from None
    if not isinstance(report, dict) or report.get("kind") != "llm-gateway knee sweep" or not report.get("levels"):
        raise CompareError(f"{path}: not an `llm-gateway knee` JSON record (or it has no levels)")
    return report


def label_of(path: Path) -> str:
    return path.stem.removeprefix("knee-")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    levels = report["levels"]
    cap = report["knee"].get("recommended")
    at_cap = next((r for r in levels if r["concurrency"] == cap), None)
    peak = max(levels, key=lambda r: r["output_tokens_per_s"])
    return {"cap": cap, "cap_tps": at_cap and at_cap["output_tokens_per_s"], "cap_ttft_p99": at_cap and
            at_cap["ttft_p99_s"], "peak_tps": peak["output_tokens_per_s"], "peak_c": peak["concurrency"]}


def format_compare(reports: list[dict[str, Any]], labels: list[str]) -> str:
    """Per sweep: cap and the figures there; then throughput per level, each sweep against the first."""
    rows: list[tuple[str, ...]] = [
        ("sweep", "cap", "tok/s at cap", "TTFT p99 at cap", "peak tok/s (at c)", "vs first at cap")]
    base = summary(reports[0])
    for report, label in zip(reports, labels):
        s = summary(report)
        ratio = "-" if not (s["cap_tps"] and base["cap_tps"]) else f"{s['cap_tps'] / base['cap_tps']:.2f}x"
        rows.append((label, "-" if s["cap"] is None else str(s["cap"]), _num(s["cap_tps"]), _ms(s["cap_ttft_p99"]),
                     f"{s['peak_tps']:.0f} ({s['peak_c']})", ratio))
    lines = _grid(rows)
    levels = sorted({r["concurrency"] for report in reports for r in report["levels"]})
    by = [{r["concurrency"]: r for r in report["levels"]} for report in reports]
    rows = [("c", *(f"{label} tok/s" for label in labels), *(f"{label} TTFT p99 ms" for label in labels[:4]))]
    for c in levels:
        tps = []
        for i, levels_of in enumerate(by):
            r = levels_of.get(c)
            cell = "-" if r is None else f"{r['output_tokens_per_s']:.0f}"
            first = by[0].get(c)
            if r is not None and i and first and first["output_tokens_per_s"]:
                cell += f" ({r['output_tokens_per_s'] / first['output_tokens_per_s']:.2f}x)"
            tps.append(cell)
        lat = [_ms(levels_of[c]["ttft_p99_s"]) if c in levels_of else "-" for levels_of in by[:4]]
        rows.append((str(c), *tps, *lat))
    return "\n".join(lines + [""] + _grid(rows))


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def write_compare_png(reports: list[dict[str, Any]], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, height_ratios=(3, 2),
                                      layout="constrained")
    levels = sorted({r["concurrency"] for report in reports for r in report["levels"]})
    for i, (report, label) in enumerate(zip(reports, labels)):
        colour = COLOURS[i % len(COLOURS)]
        rows = report["levels"]
        cs = [r["concurrency"] for r in rows]
        s = summary(report)
        cap = "" if s["cap"] is None else f", cap {s['cap']}: {s['cap_tps']:.0f} tok/s"
        top.plot(cs, [r["output_tokens_per_s"] for r in rows], "o-", color=colour, lw=2.2, ms=5,
                 label=f"{label}{cap}")
        bottom.plot(cs, [float("nan") if r["ttft_p99_s"] is None else r["ttft_p99_s"] * 1000 for r in rows], "s--",
                    color=colour, lw=1.6, ms=4, label=label)
        if s["cap"] is not None:
            for axis in (top, bottom):
                axis.axvline(s["cap"], color=colour, lw=1.5, alpha=0.6, ls=":")
            top.plot(s["cap"], s["cap_tps"], "o", ms=13, mfc="none", mec=colour, mew=2)
    top.set_ylabel("output tokens / s")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left", fontsize=9)
    first = reports[0]["inputs"]
    top.set_title(f"{len(reports)} sweeps compared (circles: each one's recommended cap)\n"
                  f"{first.get('prompt_tokens')} prompt / {first.get('output_tokens')} output tokens, closed loop",
                  fontsize=11)
    bottom.set_ylabel("TTFT p99 (ms, log)")
    bottom.set_yscale("log")
    bottom.yaxis.set_major_formatter(ScalarFormatter())  # 400, not 4x10^2
    bottom.yaxis.set_minor_formatter(NullFormatter())
    bottom.grid(True, alpha=0.3, which="both")
    bottom.set_xscale("log", base=2)
    bottom.xaxis.set_major_locator(FixedLocator(levels))
    bottom.xaxis.set_minor_locator(NullLocator())
    bottom.set_xticks(levels, [str(c) for c in levels])
    bottom.set_xlabel("concurrent requests (log2 scale)")
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
