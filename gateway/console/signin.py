"""Signing in (pasting an admin JWT) and out. The token is checked exactly as the admin API checks it, and kept
server-side in a console session (gateway/console/session.py); signing out deletes that session. With
`admin.oidc.console` the page also offers signing in at the identity provider (gateway/console/sso.py)."""

from __future__ import annotations

import hmac

from litestar import get, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import Redirect, Template

from gateway.http.asgi import AnyRequest
from gateway.console.render import page
from gateway.console.session import (
    CSRF_FIELD,
    SESSION,
    SIGNIN,
    Guarded,
    Sessions,
    form_of,
    gone,
    session_cookie,
    session_lifetime,
    signin_nonce,
)
from policies.errors import AuthenticationFailed, PermissionDenied, StateUnavailable

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
INVALID = "That token was not accepted: it is malformed, expired, or not an admin token of this gateway."


def signin_page(gateway: Guarded, request: AnyRequest, error: str | None = None, status: int = 200) -> Template:
    """The sign-in page (with `error` said on it), its form's nonce in a fresh cookie."""
    nonce, cookie = signin_nonce(gateway)
    # A Secure cookie over plain HTTP to a host that is not loopback: the browser drops it, so say why.
    plain = (request.url.scheme == "http" and gateway.policy.console.secure_cookie
             and request.url.hostname not in LOOPBACK)
    oidc = gateway.admin_auth.config.oidc
    provider = oidc.console.button if oidc is not None and oidc.console is not None else None
    response = page(request, "signin.html", "Sign in", status=status, nonce=nonce, error=error, plain=plain,
                    provider=provider)
    response.cookies.append(cookie)
    return response


def handlers(gateway: Guarded, sessions: Sessions, landing: str, team_landing: str) -> list[HTTPRouteHandler]:
    """`landing`: where signing in leads; `team_landing`: where it leads a team admin (a page of its team's)."""
    def form(request: AnyRequest, error: str | None = None, status: int = 200) -> Template:
        return signin_page(gateway, request, error, status)

    @get("/signin", opt={"public": True}, sync_to_thread=False)
    def show(request: AnyRequest) -> Template:
        return form(request)

    @post("/signin", opt={"public": True}, status_code=303)
    async def sign_in(request: AnyRequest) -> Template | Redirect:
        fields = await form_of(request)
        nonce = request.cookies.get(SIGNIN)
        if not nonce or not hmac.compare_digest(nonce, fields.get(CSRF_FIELD, "")):
            return form(request, "The sign-in form expired or came from another site: try again.", 403)
        token = fields.get("token", "").strip()
        try:
            claims = await gateway.admin_auth.check(f"Bearer {token}", write=False, team_admin=True)
        except AuthenticationFailed:
            return form(request, INVALID, 401)
        except PermissionDenied as exc:  # an OIDC token with no role mapped
            return form(request, str(exc), 403)
        except StateUnavailable as exc:
            return form(request, str(exc), 503)
        previous = request.cookies.get(SESSION)
        if previous:  # signing in again ends the session the browser had
            sessions.close(previous)
        seconds = session_lifetime(gateway, claims)
        response = Redirect(team_landing if claims.get("role") == "team_admin" else landing, status_code=303)
        response.cookies.extend([session_cookie(gateway, sessions.open(token, seconds), seconds),
                                 gone(gateway, SIGNIN)])
        return response

    @post("/signout", opt={"role": "viewer", "team": True}, status_code=303)
    async def sign_out(request: AnyRequest) -> Redirect:
        sessions.close(request.cookies.get(SESSION, ""))  # every copy of the cookie stops working now
        response = Redirect(f"{landing.rsplit('/', 1)[0]}/signin", status_code=303)
        response.cookies.append(gone(gateway, SESSION))
        return response

    return [show, sign_in, sign_out]
