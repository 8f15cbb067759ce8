"""The admin commands' side of a running gateway's /admin API: the flags that say where it is and as whom
(`--url`, `--token`, `--json`), and the calls, each saying on stderr what went wrong (never the token)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import httpx

Request = tuple[str, str, dict[str, Any] | None]  # an admin API call: method, URL, JSON body
NO_TOKEN = 2  # the exit status when no admin token was given


def add_connection(parser: argparse.ArgumentParser, roles: str) -> None:
    """`--url` and `--token` (from $LLM_GATEWAY_URL and $LLM_GATEWAY_ADMIN_TOKEN); `roles` names the tokens that
    suffice, e.g. "admin, operator or viewer"."""
    parser.add_argument("--url", default=os.environ.get("LLM_GATEWAY_URL", "http://127.0.0.1:8080"))
    parser.add_argument("--token", default=os.environ.get("LLM_GATEWAY_ADMIN_TOKEN"),
                        help=f"{roles} JWT (default: $LLM_GATEWAY_ADMIN_TOKEN)")


def add_json(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--json`: print the answer as the API gives it, for scripts."""
    parser.add_argument("--json", action="store_true", help=help_text)


def token_missing(args: argparse.Namespace, command: str, mint: str = "llm-gateway admin-token") -> bool:
    """True, after saying how to get one, when `args` has no admin token (the command then exits NO_TOKEN)."""
    if args.token:
        return False
    print(f"{command}: an admin token is needed: --token or $LLM_GATEWAY_ADMIN_TOKEN (mint one with `{mint}`)",
          file=sys.stderr)
    return True


def authorization(args: argparse.Namespace) -> dict[str, str]:
    return {"authorization": f"Bearer {args.token}"}


def unreachable(args: argparse.Namespace, command: str, exc: httpx.HTTPError) -> int:
    print(f"{command}: cannot reach the gateway at {args.url}: {type(exc).__name__}", file=sys.stderr)
    return 1


def send(args: argparse.Namespace, command: str, request: Callable[[], Request],
         show: Callable[[str, Any], str]) -> int:
    """One admin API call, built by `request()` (which may read the record first); prints
    `show(action, answer)` (or the JSON with --json), or what went wrong."""
    if token_missing(args, command):
        return NO_TOKEN
    try:
        method, url, body = request()
        response = httpx.request(method, url, json=body, headers=authorization(args), timeout=10)
    except httpx.HTTPError as exc:
        return unreachable(args, command, exc)
    if response.status_code >= 400:
        print(f"{command} {args.action}: HTTP {response.status_code}: {error_message(response)}", file=sys.stderr)
        return 1
    try:
        data = response.json() if response.content else {}
    except ValueError:
        data = {}
    print(json.dumps(data, indent=2) if args.json else show(args.action, data))
    return 0


def error_message(response: httpx.Response) -> str:
    """The message of the gateway's error answer ({"error": {"message": ...}}), else the answer's first 300
    characters."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    return message if isinstance(message, str) and message else response.text[:300]


def over_current_budget(body: dict[str, Any], args: argparse.Namespace, url: str) -> dict[str, Any]:
    """`body` with its budget flags laid over the current record's budget at `url` (a key's or a team's: the API
    replaces a whole budget), or the budget dropped with --no-budget."""
    if args.no_budget:
        body["budget"] = None
    elif "budget" in body:
        current = httpx.get(url, headers=authorization(args), timeout=10)
        if current.status_code == 200:  # else the PATCH reports what is wrong (no such record, bad token)
            body["budget"] = {**(current.json().get("budget") or {}), **body["budget"]}
    return body


def admin_get(args: argparse.Namespace, command: str, path: str, params: dict[str, Any]) -> dict[str, Any] | int:
    """GET an admin view with the viewer (or admin) token of `args`; the JSON, or the exit status after saying
    what went wrong."""
    if token_missing(args, command, mint="llm-gateway admin-token --role viewer"):
        return NO_TOKEN
    try:
        response = httpx.get(args.url.rstrip("/") + path, params=params, timeout=60, headers=authorization(args))
    except httpx.HTTPError as exc:
        return unreachable(args, command, exc)
    if response.status_code != 200:
        print(f"{command}: HTTP {response.status_code}: {error_message(response)}", file=sys.stderr)
        return 1
    answer: dict[str, Any] = response.json()
    return answer
