"""`llm-gateway keys ...` and `llm-gateway admin-token`: the admin API from a terminal.

Talks to a running gateway's /admin API (URL and token from flags or LLM_GATEWAY_URL / LLM_GATEWAY_ADMIN_TOKEN).
Prints tables for people and `--json` for scripts. A created or rotated key is printed once, never logged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import httpx

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
Request = tuple[str, str, dict[str, Any] | None]  # an admin API call: method, URL, JSON body


def seconds(text: str) -> float:
    """'90', '90s', '15m', '1h', '30d' -> seconds."""
    match = DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 15m, 1h, 30d)")
    return float(match.group(1)) * UNITS[match.group(2)]


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = sub.add_parser("admin-token", help="mint an admin JWT from the configured secret")
    token.add_argument("--config", "-c", help="the policy file (for algorithm, issuer, audience)")
    token.add_argument("--ttl", type=seconds, default=3600.0, help="lifetime, e.g. 1h (default 1h)")
    token.add_argument("--role", choices=["admin", "operator", "viewer", "team_admin"], default="admin")
    token.add_argument("--team", help="the team a team_admin token manages")
    token.add_argument("--subject", default="admin")
    token.add_argument("--private-key-file", help="PEM private key, for RS256/ES256")

    keys = sub.add_parser("keys", help="manage API keys on a running gateway")
    keys.add_argument("--url", default=os.environ.get("LLM_GATEWAY_URL", "http://127.0.0.1:8080"))
    keys.add_argument("--token", default=os.environ.get("LLM_GATEWAY_ADMIN_TOKEN"),
                      help="admin JWT (default: $LLM_GATEWAY_ADMIN_TOKEN)")
    keys.add_argument("--json", action="store_true", help="print JSON instead of tables")
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


def update_body(args: argparse.Namespace, url: str, headers: dict[str, Any]) -> dict[str, Any]:
    """The PATCH for `keys update`. The API replaces a key's whole budget, so the budget flags given are laid
    over the key's current budget: `--when-spent reject` alone must not drop its max_rented_spend."""
    return over_current_budget(settings(args), args, url, headers)


def over_current_budget(body: dict[str, Any], args: argparse.Namespace, url: str,
                        headers: dict[str, Any]) -> dict[str, Any]:
    """`body` with its budget flags laid over the current record's budget at `url` (a key's or a team's), or
    the budget dropped with --no-budget."""
    if args.no_budget:
        body["budget"] = None
    elif "budget" in body:
        current = httpx.get(url, headers=headers, timeout=10)
        if current.status_code == 200:  # else the PATCH reports what is wrong (no such record, bad token)
            body["budget"] = {**(current.json().get("budget") or {}), **body["budget"]}
    return body


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
    if not args.token:
        print("keys: an admin token is needed: --token or $LLM_GATEWAY_ADMIN_TOKEN "
              "(mint one with `llm-gateway admin-token`)", file=sys.stderr)
        return 2
    base = args.url.rstrip("/") + "/admin/keys"
    headers = {"authorization": f"Bearer {args.token}"}
    requests: dict[str, Callable[[], Request]] = {
        "create": lambda: ("POST", base, {**settings(args), "expires_in": args.expires_in}),
        "update": lambda: ("PATCH", f"{base}/{args.id}", update_body(args, f"{base}/{args.id}", headers)),
        "list": lambda: ("GET", base + (f"?team={args.team}" if args.team else ""), None),
        "show": lambda: ("GET", f"{base}/{args.id}", None),
        "usage": lambda: ("GET", f"{base}/{args.id}/usage", None),
        "budget": lambda: ("GET", f"{base}/{args.id}/budget", None),
        "revoke": lambda: ("POST", f"{base}/{args.id}/revoke", None),
        "rotate": lambda: ("POST", f"{base}/{args.id}/rotate", {"grace_seconds": args.grace}),
    }
    try:
        method, url, body = requests[args.action]()
    except httpx.HTTPError as exc:
        print(f"keys: cannot reach the gateway at {args.url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    if args.action == "create" and body is not None and body["expires_in"] is None:
        del body["expires_in"]
    return send(args, "keys", method, url, body, headers, render)


def send(args: argparse.Namespace, command: str, method: str, url: str, body: dict[str, Any] | None,
         headers: dict[str, Any],
         show: Callable[[str, Any], str]) -> int:
    """One admin API call; prints `show(action, answer)` (or the JSON with --json), or what went wrong."""
    try:
        response = httpx.request(method, url, json=body, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        print(f"{command}: cannot reach the gateway at {args.url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    try:
        data = response.json() if response.content else {}
    except ValueError:
        data = {}
    if response.status_code >= 400:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        print(f"{command} {args.action}: HTTP {response.status_code}: {message or response.text[:300]}",
              file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if args.json else show(args.action, data))
    return 0


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


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


def usage_table(data: dict[str, Any]) -> str:
    rows = [[m, c.get("requests", 0), c.get("prompt_tokens", 0), c.get("completion_tokens", 0)]
            for m, c in sorted(data["models"].items())]
    return table(rows, ["MODEL", "REQUESTS", "PROMPT TOKENS", "COMPLETION TOKENS"])


def budget_table(data: dict[str, Any]) -> str:
    spend = f"{data['rented_spend']:g}" + (f" of {data['max_rented_spend']:g}" if data["max_rented_spend"]
                                          is not None else "")
    tokens = "-" if data["tokens"] is None else f"{data['tokens']} of {data['max_tokens_per_period']}"
    return table([[data["id"], data["period"], spend, tokens, data["when_spent"], when(data["resets_at"])]],
                 ["ID", "PERIOD", "RENTED SPEND", "TOKENS", "WHEN SPENT", "RESETS"])
