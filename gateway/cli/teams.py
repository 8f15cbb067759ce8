"""`llm-gateway teams ...`: a running gateway's teams from a terminal (the admin API's /admin/teams).

URL and token as for `keys` (flags or LLM_GATEWAY_URL / LLM_GATEWAY_ADMIN_TOKEN); tables for people, `--json`
for scripts. Keys join a team with `keys create --team NAME` (or `keys update ID --team NAME`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from gateway.cli.admin_api import Request, add_connection, add_json, over_current_budget, send
from gateway.cli.keys import add_budget_flags, ceilings
from gateway.cli.text import budget_table, table, usage_table


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    teams = sub.add_parser("teams", help="manage teams (shared limits, budget and ceiling of their keys)")
    add_connection(teams, roles="admin")
    add_json(teams, "print JSON instead of tables")
    teams.set_defaults(run=run)
    actions = teams.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a team")
    create.add_argument("name")
    add_settings(create)
    update = actions.add_parser("update", help="change a team (refused while a key of it would exceed the change)")
    update.add_argument("name")
    add_settings(update)
    update.add_argument("--all-models", action="store_true", help="let the team's keys use every model")
    update.add_argument("--no-budget", action="store_true", help="remove the team's budget")
    update.add_argument("--no-max-priority-class", action="store_true", help="remove the team's priority ceiling")
    actions.add_parser("list", help="list teams")
    for action in ("show", "delete", "usage", "budget"):
        actions.add_parser(action, help=f"{action} one team").add_argument("name")


def add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--description")
    parser.add_argument("--models", help="comma-separated models its keys may use (default: all)")
    parser.add_argument("--data-policy", choices=["private_only", "allow_rented"],
                        help="the most its keys may allow (default private_only)")
    parser.add_argument("--max-priority-class", help="the most urgent priority class its keys may name and its"
                        " calls get, e.g. interactive (default: no ceiling)")
    parser.add_argument("--rpm", type=int, help="requests per minute, all its keys together")
    parser.add_argument("--tpm", type=int, help="tokens per minute, all its keys together")
    parser.add_argument("--max-concurrent", type=int, help="requests in flight at once, all its keys together")
    add_budget_flags(parser)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {k: getattr(args, k) for k in ("description", "data_policy", "max_priority_class")
                  if getattr(args, k) is not None}
    return {**body, **ceilings(args)}


def update_body(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """The PATCH for `teams update`: budget flags laid over the team's current budget (the API replaces it)."""
    body = settings(args)
    if args.all_models:
        body["models"] = None
    if args.no_max_priority_class:
        body["max_priority_class"] = None
    return over_current_budget(body, args, url)


def run(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/") + "/admin/teams"
    one = f"{base}/{getattr(args, 'name', '')}"
    requests: dict[str, Callable[[], Request]] = {
        "create": lambda: ("POST", base, {"name": args.name, **settings(args)}),
        "update": lambda: ("PATCH", one, update_body(args, one)),
        "list": lambda: ("GET", base, None),
        "show": lambda: ("GET", one, None),
        "delete": lambda: ("DELETE", one, None),
        "usage": lambda: ("GET", f"{one}/usage", None),
        "budget": lambda: ("GET", f"{one}/budget", None),
    }
    return send(args, "teams", requests[args.action], render)


def team_row(t: dict[str, Any]) -> list[str]:
    limits = t["limits"]
    budget = t["budget"] or {}
    shown = [f"{name}={limits[field]}" for name, field in (("rpm", "requests_per_minute"), ("tpm", "tokens_per_minute"),
                                                            ("conc", "max_concurrent")) if limits.get(field)]
    spend = [f"{name}={budget[field]:g}/{budget['period']}" for name, field in
             (("rented", "max_rented_spend"), ("tokens", "max_tokens_per_period")) if budget.get(field) is not None]
    return [t["name"], ",".join(t["models"]) if t["models"] is not None else "*", t["data_policy"],
            " ".join(shown) or "-", " ".join(spend) or "-", t.get("max_priority_class") or "-"]


TEAM_HEADER = ["NAME", "MODELS", "DATA POLICY", "LIMITS", "BUDGET", "MAX CLASS"]


def render(action: str, data: Any) -> str:
    if action == "list":
        return table([team_row(t) for t in data], TEAM_HEADER)
    if action == "usage":
        keys = table([[k, c.get("requests", 0), c.get("prompt_tokens", 0) + c.get("completion_tokens", 0)]
                      for k, c in sorted(data["keys"].items())], ["KEY", "REQUESTS", "TOKENS"])
        return f"{usage_table(data)}\n\n{keys}"
    if action == "budget":
        return budget_table(data)
    if action == "delete":
        return f"deleted team {data['name']}"
    return table([team_row(data)], TEAM_HEADER)
