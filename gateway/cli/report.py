"""`llm-gateway report`: own or rent, from a running gateway's ledger (GET /admin/report, a viewer token is enough).

Prints a table per model with the numbers behind the recommendation, `--json` for scripts, and `--png FILE`
for a chart of utilisation and cost over the window (owned vs rented; matplotlib, the `knee` extra).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from gateway.cli.admin_api import add_connection, add_json, admin_get
from gateway.cli.text import seconds, table, when


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = sub.add_parser("report", help="own or rent: utilisation and cost per model from the gateway's ledger")
    add_connection(report, roles="admin or viewer")
    report.add_argument("--window", type=seconds, default=86400.0, help="e.g. 1h, 7d (default 1d)")
    report.add_argument("--until", type=int, help="end of the window, unix seconds (default: now)")
    report.add_argument("--team", help="only this team's calls (a team admin token: its own team)")
    add_json(report, "print the report as JSON")
    report.add_argument("--png", type=Path, help="also write a chart of utilisation and cost over time")
    report.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = {"window": max(1, round(args.window)), **({"until": args.until} if args.until is not None else {}),
              **({"team": args.team} if args.team else {})}
    report = admin_get(args, "report", "/admin/report", params)
    if isinstance(report, int):
        return report
    print(json.dumps(report, indent=2) if args.json else render(report))
    if args.png:
        try:
            write_png(report, args.png)
        except ModuleNotFoundError as exc:
            print(f"report: the chart needs matplotlib (pip install 'llm-gateway[knee]'): {exc}", file=sys.stderr)
            return 1
        print(f"chart: {args.png}", file=sys.stderr)
    return 0


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "%":
        return f"{value:.1%}"
    if kind == "x":
        return f"{value:.2f}x"
    return f"{value:,.4f}" if isinstance(value, float) else f"{value:,}"


def render(report: dict[str, Any]) -> str:
    out = [f"own or rent, {when(report['since'])} - {when(report['until'])} "
           f"({report['window_seconds'] / 3600:.2f} h)", ""]
    rows = []
    for name, m in report["models"].items():
        owned, rented = m["owned"], m["rented"]
        rows.append([name, _fmt(m["utilisation"], "%"), _fmt(owned["prompt_tokens"] + owned["completion_tokens"]),
                     _fmt(rented["prompt_tokens"] + rented["completion_tokens"]), _fmt(m["owned_cost"]),
                     _fmt(m["owned_cost_per_million_tokens"]), _fmt(m["rented_price_per_million_tokens"]),
                     _fmt(rented["cost"]), _fmt(m["rent_all_cost"]), _fmt(m["burstiness"], "x"),
                     m["recommendation"]["verdict"]])
    out.append(table(rows, ["MODEL", "UTILISATION", "OWNED TOKENS", "RENTED TOKENS", "OWNED COST", "OWNED /M",
                            "RENTED /M", "RENTED COST", "RENT-ALL COST", "PEAK/MEAN", "RECOMMENDATION"]))
    out.append("")
    for name, m in report["models"].items():
        out.append(f"{name}: {m['recommendation']['verdict']}: {m['recommendation']['reason']}")
        rented = m["rented"]
        if rented["requests"]:
            out.append(f"  rented: {rented['requests']:,} requests, {rented['estimated_requests']:,} of them charged"
                       " the gateway's estimate (the provider sent no usage)")
        for b in m["backends"]:
            out.append(f"  {b['name']}: busy {_fmt(b['utilisation'], '%')}, {b['average_in_flight']:.2f} in flight"
                       f" on average" + (f" of a cap of {b['cap']} ({b['in_flight_vs_cap']:.0%})" if b["cap"] else ""))
    if report.get("teams"):
        out.extend(["", table([[name, f"{t['requests']:,}", f"{t['tokens']:,}", f"{t['rented_requests']:,}",
                                _fmt(t["rented_cost"])] for name, t in sorted(report["teams"].items())],
                              ["TEAM", "REQUESTS", "TOKENS", "RENTED REQUESTS", "RENTED COST"])])
    return "\n".join(out)


def chart_lines(report: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """One model's lines over the window, each point at an edge of the series: `edges` runs from the first
    point's start to the window's end (so the last point is drawn as wide as it is);
    `utilisation` holds each bucket's value (drawn as steps, the last repeated to the end), and the costs are
    cumulative at each edge, from 0 at the start to the window's total at its end."""
    points = m["series"]
    edges = [p["t"] for p in points] + [points[-1]["t"] + points[-1]["seconds"]]
    return {
        "edges": [datetime.datetime.fromtimestamp(t, datetime.timezone.utc) for t in edges],
        "utilisation": [p["utilisation"] * 100 for p in points] + [points[-1]["utilisation"] * 100],
        **{field: _cumulative(points, field) for field in ("owned_cost", "rent_all_cost", "rented_cost")},
        "paid": _cumulative([{"paid": p["owned_cost"] + p["rented_cost"]} for p in points], "paid"),
    }


def write_png(report: dict[str, Any], path: Path) -> None:
    """Two panels over the window: utilisation of the owned backends per model; cumulative cost, owned vs
    renting everything vs what was actually paid (owned + rented overflow, the line the verdict compares), with
    the owned and rented parts (each line's total in the legend, so a line
    flattened against a much dearer one still reads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, (util, cost) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, m) in enumerate(report["models"].items()):
        color = colors[i % len(colors)]
        if not m["series"]:
            continue
        lines = chart_lines(report, m)
        times = lines["edges"]
        util.plot(times, lines["utilisation"], color=color, lw=1.8, drawstyle="steps-post",
                  label=f"{name} (window {_fmt(m['utilisation'], '%')})")
        cost.plot(times, lines["paid"], color=color, lw=3.0,
                  label=f"{name}: actually paid (owned + rented overflow): {_total(lines['paid'])}")
        cost.plot(times, lines["owned_cost"], color=color, lw=1.2, ls="-.",
                  label=f"{name}: owned (GPU hours): {_total(lines['owned_cost'])}")
        if m["rent_all_cost"] is not None:
            cost.plot(times, lines["rent_all_cost"], color=color, lw=1.8, ls="--",
                      label=f"{name}: if all traffic were rented: {_total(lines['rent_all_cost'])}")
        if m["rented"]["requests"]:
            cost.plot(times, lines["rented_cost"], color=color, lw=1.2, ls=":",
                      label=f"{name}: rented overflow paid: {_total(lines['rented_cost'])}")
    util.set_ylabel("owned backends busy (%)")
    util.set_ylim(0, 105)
    util.grid(True, alpha=0.3)
    util.legend(loc="upper left", fontsize=8)
    util.set_title("Utilisation of the owned backends (time with at least one request in flight)", fontsize=10)
    cost.set_ylabel("cumulative cost (currency units)")
    cost.set_xlabel("time (UTC)")
    cost.grid(True, alpha=0.3)
    cost.legend(loc="upper left", fontsize=8)
    cost.set_title("Cost over the window: actually paid vs renting everything", fontsize=10)
    locator = mdates.AutoDateLocator()
    cost.xaxis.set_major_locator(locator)
    cost.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    verdicts = "; ".join(f"{n}: {m['recommendation']['verdict']}" for n, m in report["models"].items())
    fig.suptitle(f"Own or rent, {when(report['since'])} to {when(report['until'])}\n{verdicts}", fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cumulative(points: list[dict[str, Any]], field: str) -> list[float]:
    """The running total of `field` at each bucket's edge: 0 at the first bucket's start."""
    total, out = 0.0, [0.0]
    for p in points:
        total += p[field] or 0.0
        out.append(total)
    return out


def _total(line: list[float]) -> str:
    return f"{line[-1]:.4g}"
