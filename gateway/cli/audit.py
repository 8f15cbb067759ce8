"""`llm-gateway audit`: the audit log of a running gateway (GET /admin/audit, a viewer token is enough).

Newest first, one line per admin act: when, who (subject, role), from where, what and on what, and what changed.
Filters go to the server; `--before` pages back (the command prints the value for the next page). `--json`
prints the page as the API returns it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from gateway.cli.admin_api import add_connection, add_json, admin_get
from gateway.cli.text import seconds, table, when

CHANGES_WIDTH = 100  # characters of a change shown in the table; --json has all of it


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = sub.add_parser("audit", help="who did what through the admin API (and policy reloads)")
    add_connection(audit, roles="admin, operator or viewer")
    audit.add_argument("--actor", help="only this subject (the token's sub)")
    audit.add_argument("--action", help="only this action, e.g. key.create, key.revoke, variants.weights")
    audit.add_argument("--target", help="only acts on this key id, model or file")
    audit.add_argument("--since", type=seconds, help="only this recent, e.g. 1h, 7d")
    audit.add_argument("--before", help="the page after this event id (printed at the end of a page)")
    audit.add_argument("--limit", type=int, default=50, help="events per page (at most 500; default 50)")
    add_json(audit, "print the page as JSON")
    audit.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    for name in ("actor", "action", "target", "before"):
        if getattr(args, name):
            params[name] = getattr(args, name)
    if args.since:
        params["since"] = time.time() - args.since
    page = admin_get(args, "audit", "/admin/audit", params)
    if isinstance(page, int):
        return page
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    print(render(page))
    if page.get("next"):
        print(f"\nolder events: --before {page['next']}", file=sys.stderr)
    return 0


def render(page: dict[str, Any]) -> str:
    rows = []
    for e in page["events"]:
        changes = json.dumps(e["changes"], separators=(",", ":"), default=str)
        if len(changes) > CHANGES_WIDTH:
            changes = changes[:CHANGES_WIDTH - 3] + "..."
        who = e["actor"] + (f" ({e['role']}, {e['team']})" if e.get("team") else f" ({e['role']})")
        rows.append([when(e["at"]), who, e["address"] or "-", e["action"], e["target"], changes])
    return table(rows, ["TIME", "ACTOR", "FROM", "ACTION", "TARGET", "CHANGES"])
