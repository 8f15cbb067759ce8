"""`llm-gateway variants`: every model's variants side by side, from a running gateway (GET /admin/variants).

One table per model: weight, requests, errors held against the variant, backend TTFT and inter-token latency
(medians; and per load level with --by-load, since a light canary is only comparable at the same load),
output tokens/s per stream, structured-output validity, finish_reason=length rate and, for shadows, agreement
with the live answer. `--json` prints the view as it is.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gateway.cli.admin_api import add_connection, add_json, admin_get
from gateway.cli.text import seconds, table


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    variants = sub.add_parser("variants", help="compare each model's variants: speed, errors, structured validity")
    add_connection(variants, roles="admin, operator or viewer")
    variants.add_argument("--window", type=seconds, help="only calls this recent, e.g. 15m (default: the whole"
                                                         " window the gateway keeps)")
    variants.add_argument("--by-load", action="store_true", help="also TTFT and ITL per load level")
    add_json(variants, "print the view as JSON")
    variants.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = {"window": max(1, round(args.window))} if args.window else {}
    view = admin_get(args, "variants", "/admin/variants", params)
    if isinstance(view, int):
        return view
    print(json.dumps(view, indent=2) if args.json else render(view, args.by_load))
    return 0


HEADER = ["VARIANT", "WEIGHT", "REQUESTS", "ERRORS", "TTFT P50", "ITL P50", "TOK/S", "VALID", "LENGTH", "AGREE",
          "GUARD"]


def render(view: dict[str, Any], by_load: bool = False) -> str:
    out = []
    for model, entry in view.get("models", {}).items():
        rows = []
        for v in entry["variants"]:
            name = v["name"] + (" (shadow)" if v["shadow"] else "")
            guard = v.get("guard") or {}
            rows.append([name, f"{v['weight']:g}", v["requests"], pct(v["error_rate"]), ms(v["ttft_p50"]),
                         ms(v["itl_p50"]), num(v["tokens_per_second_p50"]),
                         f"{pct(v['structured_valid_rate'])} of {v['structured']}", pct(v["length_rate"]),
                         pct(v["agreement_rate"]), guard.get("state", "-")])
        out.append(f"model {model}\n" + table(rows, HEADER))
        for v in entry["variants"]:
            reason = (v.get("guard") or {}).get("reason")
            if reason:
                out.append(f"  {v['name']}: {reason}")
            guard = v.get("guard") or {}
            if guard.get("undecided"):
                waited = guard.get("undecided_for_s") or 0
                out.append(f"  {v['name']}: {'WARNING: ' if guard.get('warning') else ''}cannot judge yet"
                           f" ({waited:.0f} s): {guard['undecided']}")
        if by_load:
            load_rows = [[v["name"], level, at["requests"], ms(at["ttft_p50"]), ms(at["itl_p50"])]
                         for v in entry["variants"] for level, at in v["by_load"].items()]
            out.append(table(load_rows, ["VARIANT", "LOAD <=", "REQUESTS", "TTFT P50", "ITL P50"]))
    return "\n\n".join(out) if out else "no model has variants"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
