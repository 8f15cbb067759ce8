"""Who is signed in to the console, and what a page may let them do.

Signing in is pasting an admin JWT (gateway/admin/auth.py). The token never leaves the gateway: signing in makes
a console session, a random id that is the only thing the HttpOnly, SameSite=Strict cookie scoped to /console
holds, and the session (its token and its expiry, the earlier of `console.session_seconds` and the token's own)
is kept server-side, in this process's memory (`Sessions`). Every request checks the session's token again with
the admin API's own rules, so an expired token, a changed secret or a token of another role counts at once;
signing out deletes the session, so a copy of the cookie stops working at once too. Sessions are this process's:
with several gateway replicas, the console needs session affinity (or signs in again where it lands), and a
restart signs everyone out.

Signing in at the admins' OpenID provider (gateway/console/sso.py, with `admin.oidc.console`) opens the same kind
of session around the provider's ID token instead, checked again on every request as the admin API checks the
provider's tokens (`id_token_claims`: issuer, signature by the provider's JWKS, expiry, the role mapping), with
the console's client id as the audience an ID token carries.

CSRF: every state-changing request carries a token derived from the session (HMAC of the session's id, so it
is useless without the cookie and reveals nothing of it), in the X-CSRF-Token header htmx sends or a form field
`csrf`. The sign-in form, before any session, uses a double-submit nonce (a cookie and a field that must match).
The role rule is the admin API's: viewers read, operators change variant weights and reload the policy, admins
manage keys; a page gives a role no form it may not use, and the server refuses it anyway (403). A team admin
(a `team_admin` token, bound to one team) opens only the pages marked for teams (`opt={"team": True}`: its
team's keys, usage and budget, its team's page and its team's own-or-rent figures) and every other page answers it
403; on those pages it reads and manages only its team's keys, through the same checks as the admin API's team
routes (gateway/admin/scope.py).
The guard leaves the token's verified claims in the scope (ADMIN_CLAIMS), so the audit log records each change
made here as the signed-in admin's, as the admin API's guard does.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jwt
from litestar import Request
from litestar.datastructures import Cookie
from litestar.handlers import BaseRouteHandler

from gateway.admin.audit import ADMIN_CLAIMS
from gateway.admin.auth import AdminAuth
from gateway.http.asgi import AnyConnection, AnyRequest
from gateway.needs import Configured
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
RANK = {"viewer": 0, "operator": 1, "admin": 2, "team_admin": 2}  # a team admin: an admin of its team's keys
MAX_FORM = 64 * 1024  # bytes of a console form: the largest (a key's settings) is well under 2 KiB

SECURITY_HEADERS = (
    # Scripts and styles come from this origin's files only: no inline script, no eval, no CDN.
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
     b" connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


class Guarded(Configured, Protocol):
    """What the console's guard and its sign-in ask: the console's settings in the live policy, and the check of
    admin tokens (and of the provider's ID tokens) that the admin API uses."""

    admin_auth: AdminAuth


Guard = Callable[[AnyConnection, BaseRouteHandler], Awaitable[None]]


class ConsoleOff(NotFound):
    """The policy leaves the console off: its paths answer as any unknown path does."""


class SignInNeeded(AuthenticationFailed):
    """No session, or its token no longer passes: a page sends the browser to sign in."""


@dataclass(frozen=True, slots=True)
class Viewer:
    """The signed-in admin as pages see them: a name, a role, the session's CSRF token (never the JWT) and, for a
    team admin, its team."""

    subject: str
    role: str
    csrf: str
    team: str | None = None

    def may(self, role: str) -> bool:
        return RANK[self.role] >= RANK[role]


def csrf_of(session: str) -> str:
    return hmac.new(session.encode(), b"llm-gateway console csrf", hashlib.sha256).hexdigest()


MAX_SESSIONS = 10_000  # sessions kept at once: past it, signing in drops the expired ones, then the oldest


@dataclass(frozen=True, slots=True)
class Session:
    token: str  # the admin JWT it was opened with, checked again on every request; never sent back out
    expires: float  # unix seconds
    id_token: bool = False  # `token` is an ID token from signing in at the provider (id_token_claims checks it)


class Sessions:
    """The console's sessions in this process's memory, by the SHA-256 of their id (the cookie's value)."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self.limit = limit
        self.by_id: OrderedDict[bytes, Session] = OrderedDict()  # oldest first

    @staticmethod
    def _key(session_id: str) -> bytes:
        return hashlib.sha256(session_id.encode()).digest()

    def open(self, token: str, seconds: int, id_token: bool = False) -> str:
        """A new session for `token` (an ID token of the provider: `id_token`), lasting `seconds`; its id (the
        cookie's value)."""
        now = time.time()
        if len(self.by_id) >= self.limit:
            for key in [k for k, s in self.by_id.items() if s.expires <= now]:
                del self.by_id[key]
            while len(self.by_id) >= self.limit:
                self.by_id.popitem(last=False)
        session_id = secrets.token_urlsafe(32)
        self.by_id[self._key(session_id)] = Session(token, now + seconds, id_token)
        return session_id

    def get(self, session_id: str) -> Session | None:
        """A live session, or None: unknown, signed out or expired."""
        key = self._key(session_id)
        session = self.by_id.get(key)
        if session is None:
            return None
        if session.expires <= time.time():
            del self.by_id[key]
            return None
        return session

    def close(self, session_id: str) -> None:
        self.by_id.pop(self._key(session_id), None)


async def viewer_of(gateway: Guarded, sessions: Sessions, connection: AnyConnection) -> tuple[Viewer, dict[str, Any]] | None:
    """The signed-in admin and their token's verified claims, or None: no session (never opened, signed out or
    expired), or its token no longer passes (expired, another secret, or no role this gateway maps: sign in
    again)."""
    session_id = connection.cookies.get(SESSION)
    if not session_id:
        return None
    session = sessions.get(session_id)
    if session is None:
        return None
    try:
        if session.id_token:
            claims = await id_token_claims(gateway.admin_auth, session.token)
        else:
            claims = await gateway.admin_auth.check(f"Bearer {session.token}", write=False, team_admin=True)
    except (AuthenticationFailed, PermissionDenied, StateUnavailable):
        return None
    team = claims.get("team") if claims["role"] == "team_admin" else None
    return Viewer(str(claims.get("sub") or "admin")[:100], claims["role"], csrf_of(session_id), team), claims


async def id_token_claims(admin_auth: AdminAuth, token: str) -> dict[str, Any]:
    """An ID token of the admins' provider, verified as the admin API verifies the provider's tokens
    (AdminAuth.provider_claims: issuer, an allowed algorithm, the signature by the provider's JWKS, expiry, a
    `sub`, the role from the mapped claim) with the console's client id as its audience; when it names several
    audiences, its `azp` must be that client too (OpenID Connect Core 3.1.3.7). AuthenticationFailed or
    PermissionDenied as the admin API's, never repeating the token."""
    oidc = admin_auth.config.oidc
    if oidc is None or oidc.console is None or admin_auth.oidc is None:
        raise AuthenticationFailed("signing in at the identity provider is not configured (admin.oidc.console)",
                                   code="invalid_admin_token")
    client = oidc.console.client_id
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise AuthenticationFailed("the ID token is not a well-formed JWT", code="invalid_admin_token") from None
    claims = await admin_auth.provider_claims(token, header, oidc.model_copy(update={"audience": client}))
    audience = claims.get("aud")
    if isinstance(audience, list) and len(audience) > 1 and claims.get("azp") != client:
        raise AuthenticationFailed("the ID token was issued to another client (azp)", code="invalid_admin_token")
    return claims


def session_lifetime(gateway: Configured, claims: dict[str, Any]) -> int:
    """Seconds a session opened now lasts: `console.session_seconds`, never past the token's own expiry."""
    return int(min(gateway.policy.console.session_seconds, max(1, claims["exp"] - time.time())))


def session_cookie(gateway: Configured, session_id: str, seconds: int) -> Cookie:
    return Cookie(key=SESSION, value=session_id, path=PREFIX, max_age=seconds, httponly=True, samesite="strict",
                  secure=gateway.policy.console.secure_cookie)


def lax_cookie(gateway: Configured, key: str, value: str, seconds: int) -> Cookie:
    """A cookie the browser sends back when the provider redirects it here (a top-level navigation from another
    site, which a SameSite=Strict cookie would miss); it binds a sign-in to the browser that started it."""
    return Cookie(key=key, value=value, path=PREFIX, max_age=seconds, httponly=True, samesite="lax",
                  secure=gateway.policy.console.secure_cookie)


def signin_nonce(gateway: Configured) -> tuple[str, Cookie]:
    nonce = secrets.token_urlsafe(24)
    return nonce, Cookie(key=SIGNIN, value=nonce, path=PREFIX, max_age=900, httponly=True, samesite="strict",
                         secure=gateway.policy.console.secure_cookie)


def gone(gateway: Configured, key: str) -> Cookie:
    return Cookie(key=key, value="", path=PREFIX, max_age=0, httponly=True, samesite="strict",
                  secure=gateway.policy.console.secure_cookie)


def console_guard(gateway: Guarded, sessions: Sessions) -> Guard:
    """The console router's guard: off unless the policy enables it; a session for every page but sign-in; and
    for a change, the role the handler asks for (`opt={"role": ...}`, default admin) and the CSRF token."""

    async def guard(connection: AnyConnection, handler: BaseRouteHandler) -> None:
        if not gateway.policy.console.enabled:
            raise ConsoleOff("unknown path", code="unknown_url")
        if handler.opt.get("public"):
            return
        session = await viewer_of(gateway, sessions, connection)
        if session is None:
            raise SignInNeeded("sign in to the console", code="signin_needed")
        viewer, claims = session
        connection.state.viewer = viewer
        connection.scope[ADMIN_CLAIMS] = claims  # type: ignore[literal-required]  # the audit log's actor
        if viewer.team is not None and not handler.opt.get("team"):
            raise PermissionDenied(f"a team admin (team {viewer.team}) sees its team's keys and usage only",
                                   code="team_admin_scope")
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


async def form_of(request: AnyRequest) -> dict[str, str]:
    """The request's URL-encoded form as single values (bounded: the app's body limit and MAX_FORM)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FORM:
        raise PayloadTooLarge(f"a console form holds at most {MAX_FORM} bytes", code="form_too_large")
    form = await request.form()
    return {k: v for k, v in form.items() if isinstance(v, str)}
