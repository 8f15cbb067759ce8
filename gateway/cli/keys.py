"""`llm-gateway keys ...` and `llm-gateway admin-token`: the admin API from a terminal.

Talks to a running gateway's /admin API (URL and token from flags or LLM_GATEWAY_URL / LLM_GATEWAY_ADMIN_TOKEN).
Prints tables for people and `--json` for scripts. A created or rotated key is printed once, never logged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from gateway.cli.admin_api import Request, add_connection, add_json, over_current_budget, send
from gateway.cli.text import budget_table, seconds, table, usage_table, when


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = sub.add_parser("admin-token", help="mint an admin JWT from the configured secret")
    token.add_argument("--config", "-c", help="the policy file (for algorithm, issuer, audience)")
    token.add_argument("--ttl", type=seconds, default=3600.0, help="lifetime, e.g. 1h (default 1h)")
    token.add_argument("--role", choices=["admin", "operator", "viewer", "team_admin"], default="admin")
    token.add_argument("--team", help="the team a team_admin token manages")
    token.add_argument("--subject", default="admin")
    token.add_argument("--private-key-file", help="PEM private key, for RS256/ES256")
    token.set_defaults(run=run_admin_token)

    keys = sub.add_parser("keys", help="manage API keys on a running gateway")
    add_connection(keys, roles="admin")
    add_json(keys, "print JSON instead of tables")
    keys.set_defaults(run=run_keys)
    actions = keys.add_subparsers(dest="action", required=True)

    create = actions.add_parser("create", help="issue a key; its secret is printed once")
    create.add_argument("--name", required=True)
    add_settings(create)
    update = actions.add_parser("update", help="change a key's settings")
    update.add_argument("id")
    update.add_argument("--name")
    add_settings(update)
    update.add_argument("--no-budget", action="store_true", help="remove the key's budget")
    actions.add_parser("list", help="list keys").add_argument("--team", help="only this team's keys")
    for action in ("show", "revoke", "usage", "budget"):
        actions.add_parser(action, help=f"{action} one key").add_argument("id")
    rotate = actions.add_parser("rotate", help="new secret; the old one keeps working during --grace")
    rotate.add_argument("id")
    rotate.add_argument("--grace", type=seconds, default=3600.0, help="e.g. 10m (default 1h)")


def add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--owner")
    parser.add_argument("--team", help="the team the key belongs to (it may only narrow the team's settings)")
    parser.add_argument("--models", help="comma-separated models the key may use (default: all)")
    parser.add_argument("--expires-in", type=seconds, help="e.g. 30d")
    parser.add_argument("--data-policy", choices=["private_only", "allow_rented"])
    parser.add_argument("--allowed-cidrs", help="comma-separated client networks, e.g. 10.0.0.0/8")
    parser.add_argument("--rpm", type=int, help="requests per minute")
    parser.add_argument("--tpm", type=int, help="tokens per minute")
    parser.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    parser.add_argument("--priority-class", help="e.g. interactive or batch (the policy's priorities.classes)")
    parser.add_argument("--client-priority", choices=["yes", "no"],
                        help="may its clients pick a class by header and send vLLM's `priority` field")
    add_budget_flags(parser)


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    """The budget flags a key and a team share (read back by `ceilings`)."""
    parser.add_argument("--max-rented-spend", type=float, help="budget: rented spend per period (currency units)")
    parser.add_argument("--max-tokens-per-period", type=int, help="budget: tokens per period")
    parser.add_argument("--budget-period", choices=["day", "week", "month"], help="budget period (default month)")
    parser.add_argument("--when-spent", choices=["owned_only", "reject"],
                        help="once the rented budget is spent: stay owned (default) or answer 429 until the reset")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for field in ("name", "owner", "team", "data_policy", "priority_class"):
        if getattr(args, field, None) is not None:
            body[field] = getattr(args, field)
    if args.client_priority is not None:
        body["client_priority"] = args.client_priority == "yes"
    if args.allowed_cidrs is not None:
        body["allowed_cidrs"] = [c.strip() for c in args.allowed_cidrs.split(",") if c.strip()]
    return {**body, **ceilings(args)}


def ceilings(args: argparse.Namespace) -> dict[str, Any]:
    """The models, limits and budget flags a key and a team share, as the admin API's fields."""
    body: dict[str, Any] = {}
    if args.models is not None:
        body["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    limits = {k: v for k, v in (("requests_per_minute", args.rpm), ("tokens_per_minute", args.tpm),
                                ("max_concurrent", args.max_concurrent)) if v is not None}
    if limits:
        body["limits"] = limits
    budget = {k: v for k, v in (("max_rented_spend", args.max_rented_spend),
                                ("max_tokens_per_period", args.max_tokens_per_period),
                                ("period", args.budget_period), ("when_spent", args.when_spent)) if v is not None}
    if budget:
        body["budget"] = budget
    return body


def create_body(args: argparse.Namespace) -> dict[str, Any]:
    expires = {} if args.expires_in is None else {"expires_in": args.expires_in}
    return {**settings(args), **expires}


def update_body(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """The PATCH for `keys update`. The API replaces a key's whole budget, so the budget flags given are laid
    over the key's current budget: `--when-spent reject` alone must not drop its max_rented_spend."""
    return over_current_budget(settings(args), args, url)


def run_admin_token(args: argparse.Namespace) -> int:
    from gateway.admin.auth import mint_token
    from policies.config import Admin, PolicyError, load_policy

    try:
        config = load_policy(args.config).admin if args.config else Admin()
        private = open(args.private_key_file, "rb").read() if args.private_key_file else None
        print(mint_token(config, args.ttl, role=args.role, subject=args.subject, private_key=private,
                         team=args.team))
    except (PolicyError, ValueError, OSError) as exc:
        print(f"admin-token: {exc}", file=sys.stderr)
        return 1
    return 0


def run_keys(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/") + "/admin/keys"
    requests: dict[str, Callable[[], Request]] = {
        "create": lambda: ("POST", base, create_body(args)),
        "update": lambda: ("PATCH", f"{base}/{args.id}", update_body(args, f"{base}/{args.id}")),
        "list": lambda: ("GET", base + (f"?team={args.team}" if args.team else ""), None),
        "show": lambda: ("GET", f"{base}/{args.id}", None),
        "usage": lambda: ("GET", f"{base}/{args.id}/usage", None),
        "budget": lambda: ("GET", f"{base}/{args.id}/budget", None),
        "revoke": lambda: ("POST", f"{base}/{args.id}/revoke", None),
        "rotate": lambda: ("POST", f"{base}/{args.id}/rotate", {"grace_seconds": args.grace}),
    }
    return send(args, "keys", requests[args.action], render)


def key_row(k: dict[str, Any]) -> list[str]:
    state = "revoked" if k["revoked"] else "active"
    return [k["id"], k["name"], k.get("team") or "-", state, ",".join(k["models"]) if k["models"] is not None else "*",
            k["data_policy"], k.get("priority_class") or "(default)", when(k["expires_at"]),
            when(k["last_used_at"])]


KEY_HEADER = ["ID", "NAME", "TEAM", "STATE", "MODELS", "DATA POLICY", "CLASS", "EXPIRES", "LAST USED"]


def render(action: str, data: Any) -> str:
    if action == "list":
        return table([key_row(k) for k in data], KEY_HEADER)
    if action == "usage":
        return usage_table(data)
    if action == "budget":
        return budget_table(data)
    if action in ("create", "rotate"):
        record = data["record"]
        note = "" if action == "create" else f"\nthe previous secret works until {when(record['previous_valid_until'])}"
        return (f"{table([key_row(record)], KEY_HEADER)}\n\nAPI key (shown once, store it now):\n{data['key']}"
                f"{note}")
    return table([key_row(data)], KEY_HEADER)
