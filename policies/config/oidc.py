"""`admin.oidc`: admins from the company's OpenID provider (Keycloak, Dex, Okta, Entra, Google).

The gateway reads the issuer's discovery document and its JWKS, verifies admin tokens with those keys, and maps
one claim (groups or roles) to a gateway role. The verification itself is gateway/oidc.py; these are its settings.
With `console`, the admin console signs people in at the provider too (gateway/console/sso.py).
"""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# asymmetric only: a JWKS never holds a shared secret this gateway should accept (HS*) and `none` is never one
Algorithm = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
GatewayRole = Literal["admin", "operator", "team_admin", "viewer"]
LOOPBACK_NAMES = ("localhost",)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoleGrant(Strict):
    """What one claim value (a group or role at the provider) makes its holder here."""

    role: GatewayRole
    team: str | None = Field(None, min_length=1, max_length=200, description="with role team_admin: the team")

    @model_validator(mode="after")
    def team_with_team_admin(self) -> RoleGrant:
        if (self.role == "team_admin") != (self.team is not None):
            raise ValueError("a team is given with role team_admin, and only with it")
        return self


def secure_url(url: str, what: str) -> str:
    """https, or http only to this machine (a provider started next to the gateway, as the tests do)."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return url
    if parts.scheme == "http" and parts.hostname and loopback(parts.hostname):
        return url
    raise ValueError(f"{what} must be an https URL (http only on the loopback address)")


def loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConsoleSignIn(Strict):
    """`admin.oidc.console`: the console's "Sign in with" button, the authorization code flow with PKCE as a
    client of the provider. The ID token it brings back is verified as the admin API verifies the provider's
    tokens, with `client_id` as its audience."""

    client_id: str = Field(min_length=1, max_length=200, description="the console's client at the provider")
    client_secret_env: str | None = Field(
        None, min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the client's secret; unset: a public client (PKCE only)")
    redirect_url: str | None = Field(
        None, max_length=2000, description="the callback as registered at the provider"
        " (https://HOST/console/oidc/callback); default: built from the request's scheme and host,"
        " which is right unless a proxy in front changes them")
    scopes: list[str] = Field(["openid", "profile"], min_length=1, max_length=20,
                              description="scopes asked for; `openid` is required; add the one that puts `claim`"
                                          " in the ID token if the provider needs it (often `groups`)")
    button: str = Field("your identity provider", min_length=1, max_length=100,
                        description="the provider's name on the sign-in button")
    flow_seconds: int = Field(600, ge=30, le=3600, description="how long a sign-in at the provider may take")

    @field_validator("scopes")
    @classmethod
    def with_openid(cls, scopes: list[str]) -> list[str]:
        if "openid" not in scopes:
            raise ValueError("the scopes must include openid")
        if any(not s or any(c.isspace() or c == '"' or c == "\\" for c in s) for s in scopes):
            raise ValueError("a scope is a non-empty word without spaces, quotes or backslashes")
        return scopes

    @field_validator("redirect_url")
    @classmethod
    def absolute(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("https", "http") or not parts.hostname or parts.fragment:
                raise ValueError("admin.oidc.console.redirect_url must be an absolute http(s) URL without a fragment")
        return url


class AdminOidc(Strict):
    issuer: str = Field(max_length=2000, description="the provider's issuer URL, exactly as its tokens' `iss`")
    audience: str = Field("llm-gateway-admin", min_length=1, max_length=2000)
    claim: str = Field("groups", min_length=1, max_length=200,
                       description="the claim holding the groups or roles; a dotted path reaches into objects"
                                   " (Keycloak: realm_access.roles)")
    roles: dict[str, RoleGrant] = Field(min_length=1, description="claim value -> gateway role (and team)")
    algorithms: list[Algorithm] = Field(["RS256", "ES256"], min_length=1)
    ca_file: str | None = Field(None, description="PEM bundle that verifies the provider's TLS (default: system)")
    fetch_timeout_seconds: float = Field(5.0, gt=0, le=60)
    max_document_bytes: int = Field(256 * 1024, ge=1024, le=16 * 1024 * 1024)
    refresh_seconds: float = Field(300.0, ge=1, le=86400)
    unknown_kid_refetch_seconds: float = Field(30.0, ge=0, le=3600)
    max_stale_seconds: float = Field(3600.0, ge=0, le=7 * 86400)
    console: ConsoleSignIn | None = Field(None, description="the console's sign-in with this provider; unset: the"
                                                              " console takes pasted tokens only")

    @field_validator("issuer")
    @classmethod
    def issuer_url(cls, issuer: str) -> str:
        return secure_url(issuer, "admin.oidc.issuer")

    @field_validator("roles", mode="before")
    @classmethod
    def role_names(cls, roles: object) -> object:
        """`gw-admins: admin` is short for `gw-admins: {role: admin}`."""
        if isinstance(roles, dict):
            return {value: {"role": grant} if isinstance(grant, str) else grant for value, grant in roles.items()}
        return roles
