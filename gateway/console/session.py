"""Who is signed in to the console, and what a page may let them do.

Signing in is pasting an admin JWT (gateway/admin_auth.py). The token goes into an HttpOnly, SameSite=Strict
cookie scoped to /console and nowhere else: never into a page, a URL or a log. Every request checks it again with
the admin API's own rules, so an expired token, a changed secret or a token of another role counts at once, and
several gateway replicas need no shared session store.

CSRF: every state-changing request carries a token derived from the session (HMAC of the session's secret, so it
is useless without the cookie and reveals nothing of it), in the X-CSRF-Token header htmx sends or a form field
`csrf`. The sign-in form, before any session, uses a double-submit nonce (a cookie and a field that must match).
The role rule is the admin API's: viewers read, operators change variant weights and reload the policy, admins
manage keys; a page gives a role no form it may not use, and the server refuses it anyway (403). A team admin's
token does not open the console (yet): the admin API's check refuses it where no route scopes it to a team.
The guard leaves the token's verified claims in the scope (ADMIN_CLAIMS), so the audit log records each change
made here as the signed-in admin's, as the admin API's guard does.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie

from gateway.admin_audit import ADMIN_CLAIMS
from policies.errors import (
    AuthenticationFailed,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    StateUnavailable,
)

PREFIX = "/console"
SESSION = "console_session"
SIGNIN = "console_signin"  # the sign-in form's double-submit nonce
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"
READS = ("GET", "HEAD", "OPTIONS")
RANK = {"viewer": 0, "operator": 1, "admin": 2}
MAX_FORM = 64 * 1024  # bytes of a console form: the largest (a key's settings) is well under 2 KiB

SECURITY_HEADERS = (
    # Scripts and styles come from this origin's files only: no inline script, no eval, no CDN.
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
     b" connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


class ConsoleOff(NotFound):
    """The policy leaves the console off: its paths answer as any unknown path does."""


class SignInNeeded(AuthenticationFailed):
    """No session, or its token no longer passes: a page sends the browser to sign in."""


@dataclass(frozen=True, slots=True)
class Viewer:
    """The signed-in admin as pages see them: a name, a role and the session's CSRF token (never the JWT)."""

    subject: str
    role: str
    csrf: str

    def may(self, role: str) -> bool:
        return RANK[self.role] >= RANK[role]


def csrf_of(token: str) -> str:
    return hmac.new(token.encode(), b"llm-gateway console csrf", hashlib.sha256).hexdigest()


async def viewer_of(gateway, connection: ASGIConnection) -> tuple[Viewer, dict] | None:
    """The signed-in admin and their token's verified claims, or None: no session, or its token no longer passes
    (expired, another secret, or a role the console does not take, as a team admin's: sign in again)."""
    token = connection.cookies.get(SESSION)
    if not token:
        return None
    try:
        claims = await gateway.admin_auth.check(f"Bearer {token}", write=False)
    except (AuthenticationFailed, PermissionDenied, StateUnavailable):
        return None
    return Viewer(str(claims.get("sub") or "admin")[:100], claims["role"], csrf_of(token)), claims


def session_cookie(gateway, token: str, claims: dict) -> Cookie:
    settings = gateway.policy.console
    lasts = int(min(settings.session_seconds, max(1, claims["exp"] - time.time())))
    return Cookie(key=SESSION, value=token, path=PREFIX, max_age=lasts, httponly=True, samesite="strict",
                  secure=settings.secure_cookie)


def signin_nonce(gateway) -> tuple[str, Cookie]:
    nonce = secrets.token_urlsafe(24)
    return nonce, Cookie(key=SIGNIN, value=nonce, path=PREFIX, max_age=900, httponly=True, samesite="strict",
                         secure=gateway.policy.console.secure_cookie)


def gone(gateway, key: str) -> Cookie:
    return Cookie(key=key, value="", path=PREFIX, max_age=0, httponly=True, samesite="strict",
                  secure=gateway.policy.console.secure_cookie)


def console_guard(gateway):
    """The console router's guard: off unless the policy enables it; a session for every page but sign-in; and
    for a change, the role the handler asks for (`opt={"role": ...}`, default admin) and the CSRF token."""

    async def guard(connection: ASGIConnection, handler) -> None:
        if not gateway.policy.console.enabled:
            raise ConsoleOff("unknown path", code="unknown_url")
        if handler.opt.get("public"):
            return
        session = await viewer_of(gateway, connection)
        if session is None:
            raise SignInNeeded("sign in to the console", code="signin_needed")
        viewer, claims = session
        connection.state.viewer = viewer
        connection.scope[ADMIN_CLAIMS] = claims  # type: ignore[literal-required]  # the audit log's actor
        if connection.scope["method"] in READS:  # type: ignore[typeddict-item]  # HTTP only: no websockets here
            return
        role = handler.opt.get("role", "admin")
        if not viewer.may(role):
            raise PermissionDenied(f"the {viewer.role} role may not do this", code="read_only_token")
        sent = connection.headers.get(CSRF_HEADER)
        if sent is None and isinstance(connection, Request):
            sent = (await form_of(connection)).get(CSRF_FIELD)
        if not sent or not hmac.compare_digest(str(sent), viewer.csrf):
            raise PermissionDenied("the form is stale or came from another site: reload the page",
                                   code="csrf_failed")

    return guard


async def form_of(request: Request) -> dict[str, str]:
    """The request's URL-encoded form as single values (bounded: the app's body limit and MAX_FORM)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FORM:
        raise PayloadTooLarge(f"a console form holds at most {MAX_FORM} bytes", code="form_too_large")
    form = await request.form()
    return {k: v for k, v in form.items() if isinstance(v, str)}
