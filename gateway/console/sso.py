"""Signing in to the console at the admins' OpenID provider: the authorization code flow with PKCE (RFC 7636).

With `admin.oidc.console`, the sign-in page shows a "Sign in with" button. Following it (a link, as the console's
CSP lets a form lead only to its own origin, redirects included) makes a random state, a nonce and a code
verifier, keeps them here, in this process's memory (`PendingSignIns`, by the SHA-256 of a random id), and
sends the browser to the provider's authorization endpoint (from its discovery document) with response_type=code,
the state, the nonce and the verifier's S256 challenge. Only the random id goes to the browser, in an HttpOnly
cookie scoped to /console that lives `flow_seconds`; it is SameSite=Lax, as the provider's redirect back is a
navigation from another site.

The callback takes that browser's pending sign-in (once: a second use of the same answer finds none), checks the
state and, when the provider names itself (RFC 9207's `iss`), the issuer; exchanges the code with the verifier
(and the client's secret, when the policy names its variable); verifies the ID token as the admin API verifies
the provider's tokens, with the client id as its audience (session.id_token_claims), and its nonce; and opens a
console session around the ID token, as pasting a token does around that token. Its lifetime is the paste's:
`console.session_seconds`, never past the ID token's expiry. Every failure ends on the sign-in page with what
went wrong, never a 5xx and never a token or a code.

The session cookie is SameSite=Strict, and a browser may withhold it from the redirects that follow a
navigation another site started; so the callback answers with a page that moves on to the console itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from litestar import get
from litestar.handlers import HTTPRouteHandler
from litestar.response import Redirect, Template

from gateway.http.asgi import AnyRequest
from gateway.console.render import page
from gateway.console.session import (
    PREFIX,
    SESSION,
    SIGNIN,
    Guarded,
    Sessions,
    gone,
    id_token_claims,
    lax_cookie,
    session_cookie,
    session_lifetime,
)
from gateway.console.signin import signin_page
from gateway.oidc import CodeRefused, IssuerKeys, KeysUnavailable
from policies.errors import AuthenticationFailed, PermissionDenied
from policies.config.oidc import ConsoleSignIn

log = logging.getLogger("gateway.console")

FLOW = "console_oidc"  # the cookie binding a sign-in at the provider to the browser that started it
CALLBACK = "/oidc/callback"
MAX_PENDING = 10_000  # sign-ins under way at once: past it, starting one drops the expired, then the oldest
MAX_PARAM = 4096  # characters of a code or state the callback reads


@dataclass(frozen=True, slots=True)
class Pending:
    state: str
    nonce: str
    verifier: str  # PKCE's code_verifier: the token endpoint's proof that this gateway started the flow
    redirect: str  # the redirect_uri sent, which the code exchange must repeat
    expires: float  # unix seconds


class PendingSignIns:
    """Sign-ins at the provider under way, by the SHA-256 of the id their browser's cookie holds; each is taken
    once, by the callback that ends it."""

    def __init__(self, limit: int = MAX_PENDING) -> None:
        self.limit = limit
        self.by_id: OrderedDict[bytes, Pending] = OrderedDict()  # oldest first

    def start(self, redirect: str, seconds: int) -> tuple[str, Pending]:
        now = time.time()
        if len(self.by_id) >= self.limit:
            for key in [k for k, p in self.by_id.items() if p.expires <= now]:
                del self.by_id[key]
            while len(self.by_id) >= self.limit:
                self.by_id.popitem(last=False)
        browser = secrets.token_urlsafe(32)
        pending = Pending(secrets.token_urlsafe(32), secrets.token_urlsafe(32), secrets.token_urlsafe(48), redirect,
                          now + seconds)
        self.by_id[hashlib.sha256(browser.encode()).digest()] = pending
        return browser, pending

    def take(self, browser: str) -> Pending | None:
        pending = self.by_id.pop(hashlib.sha256(browser.encode()).digest(), None)
        return pending if pending is not None and pending.expires > time.time() else None


def challenge(verifier: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()


def with_query(url: str, params: dict[str, str]) -> str:
    """`url` with `params` added to the query it may already have."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query=urlencode([*parse_qsl(parts.query), *params.items()])))


class SignInFailed(Exception):
    """A sign-in at the provider that ends on the sign-in page: the message says why, `status` how."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def handlers(gateway: Guarded, sessions: Sessions, landing: str, team_landing: str) -> list[HTTPRouteHandler]:
    pendings = PendingSignIns()

    def settings() -> tuple[ConsoleSignIn, IssuerKeys]:
        oidc = gateway.admin_auth.config.oidc
        if oidc is None or oidc.console is None or gateway.admin_auth.oidc is None:
            raise SignInFailed("Signing in at an identity provider is not configured here: paste a token.", 404)
        return oidc.console, gateway.admin_auth.oidc

    def failed(request: AnyRequest, exc: SignInFailed) -> Template:
        response = signin_page(gateway, request, str(exc), exc.status)
        response.cookies.append(gone(gateway, FLOW))
        return response

    @get("/oidc/start", opt={"public": True})
    async def start(request: AnyRequest) -> Template | Redirect:
        try:
            console, keys = settings()
            try:
                authorize = await keys.endpoint("authorization_endpoint")
            except KeysUnavailable as exc:
                raise SignInFailed(f"The identity provider cannot be reached now ({exc}): try again shortly.",
                                   503) from None
        except SignInFailed as exc:
            return failed(request, exc)
        redirect = console.redirect_url or f"{request.url.scheme}://{request.url.netloc}{PREFIX}{CALLBACK}"
        browser, pending = pendings.start(redirect, console.flow_seconds)
        response = Redirect(with_query(authorize, {
            "response_type": "code", "client_id": console.client_id, "redirect_uri": redirect,
            "scope": " ".join(console.scopes), "state": pending.state, "nonce": pending.nonce,
            "code_challenge": challenge(pending.verifier), "code_challenge_method": "S256",
        }), status_code=303)
        response.cookies.append(lax_cookie(gateway, FLOW, browser, console.flow_seconds))
        return response

    @get(CALLBACK, opt={"public": True})
    async def callback(request: AnyRequest) -> Template:
        try:
            claims, id_token = await finish(request)
        except SignInFailed as exc:
            log.warning("console: a sign-in at the identity provider failed: %s", exc)
            return failed(request, exc)
        previous = request.cookies.get(SESSION)
        if previous:  # signing in again ends the session the browser had
            sessions.close(previous)
        seconds = session_lifetime(gateway, claims)
        session = sessions.open(id_token, seconds, id_token=True)
        log.info("console: %s signed in at the identity provider as %s", str(claims["sub"])[:100], claims["role"])
        target = team_landing if claims["role"] == "team_admin" else landing
        response = page(request, "signed_in.html", "Signed in", landing=target)
        response.cookies.extend([session_cookie(gateway, session, seconds), gone(gateway, FLOW),
                                 gone(gateway, SIGNIN)])
        return response

    async def finish(request: AnyRequest) -> tuple[dict[str, Any], str]:
        """The verified claims and the ID token of the provider's answer, or SignInFailed saying why."""
        console, keys = settings()
        query = request.query_params
        pending = pendings.take(request.cookies.get(FLOW, ""))
        if pending is None:
            raise SignInFailed("No sign-in at the identity provider is under way in this browser (it expired, or"
                               " this answer was already used): sign in again.", 400)
        state = query.get("state") or ""
        if len(state) > MAX_PARAM or not hmac.compare_digest(state.encode(), pending.state.encode()):
            raise SignInFailed("The identity provider's answer does not belong to the sign-in this browser started"
                               " (state): sign in again.", 400)
        issuer = query.get("iss")
        if issuer is not None and issuer != keys.settings.issuer:
            raise SignInFailed("The answer came from another identity provider (iss): sign in again.", 400)
        error = query.get("error")
        if error is not None:
            code = error if error.replace("_", "").isalpha() and len(error) <= 64 else "an error"
            raise SignInFailed(f"The identity provider did not sign you in ({code}).", 401)
        code = query.get("code") or ""
        if not code or len(code) > MAX_PARAM:
            raise SignInFailed("The identity provider's answer has no code: sign in again.", 400)
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": pending.redirect,
                "code_verifier": pending.verifier}
        secret = os.environ.get(console.client_secret_env, "") if console.client_secret_env else ""
        if console.client_secret_env and not secret:
            raise SignInFailed(f"The console's client secret is not set ({console.client_secret_env}).", 503)
        if not secret:
            form["client_id"] = console.client_id  # a public client: the verifier is its only proof
        try:
            tokens = await keys.exchange(form, (console.client_id, secret) if secret else None)
        except CodeRefused as exc:
            raise SignInFailed(f"The identity provider refused the sign-in's code ({exc}): it was used already,"
                               " has expired, or was not issued to this sign-in. Sign in again.", 401) from None
        except KeysUnavailable as exc:
            raise SignInFailed(f"The identity provider cannot be reached now ({exc}): try again shortly.",
                               503) from None
        id_token = tokens.get("id_token")
        if not isinstance(id_token, str) or not id_token:
            raise SignInFailed("The identity provider sent no ID token (is `openid` among the scopes?).", 401)
        try:
            claims = await id_token_claims(gateway.admin_auth, id_token)
        except AuthenticationFailed as exc:
            raise SignInFailed(f"The identity provider's ID token was not accepted: {exc}.", 401) from None
        except PermissionDenied as exc:  # signed in at the provider, but no role here
            raise SignInFailed(f"You are signed in at the identity provider, but {exc}.", 403) from None
        if not hmac.compare_digest(str(claims.get("nonce", "")).encode(), pending.nonce.encode()):
            raise SignInFailed("The ID token does not belong to this sign-in (nonce): sign in again.", 401)
        return claims, id_token

    return [start, callback]
