"""Text in and out of the admin commands: durations read from flags, times and tables written for people."""

from __future__ import annotations

import argparse
import datetime
import re
from typing import Any

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(text: str) -> float:
    """'90', '90s', '15m', '1h', '30d' -> seconds."""
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 15m, 1h, 30d)")
    return float(match.group(1)) * UNITS[match.group(2)]


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def usage_table(data: dict[str, Any]) -> str:
    """A key's or a team's usage per model (GET .../usage)."""
    rows = [[m, c.get("requests", 0), c.get("prompt_tokens", 0), c.get("completion_tokens", 0)]
            for m, c in sorted(data["models"].items())]
    return table(rows, ["MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS"])


def budget_table(data: dict[str, Any]) -> str:
    """A key's or a team's budget and what is spent of it (GET .../budget)."""
    spend = f"{data['rented_spend']:g}" + (f" of {data['max_rented_spend']:g}" if data["max_rented_spend"]
                                          is not None else "")
    tokens = "-" if data["tokens"] is None else f"{data['tokens']} of {data['max_tokens_per_period']}"
    return table([[data["id"], data["period"], spend, tokens, data["when_spent"], when(data["resets_at"])]],
                 ["ID", "PERIOD", "RENTED SPEND", "TOKENS", "WHEN SPENT", "RESETS"])
