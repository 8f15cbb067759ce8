"""`admin.oidc`: admins from the company's OpenID provider (Keycloak, Dex, Okta, Entra, Google).

The gateway reads the issuer's discovery document and its JWKS, verifies admin tokens with those keys, and maps
one claim (groups or roles) to a gateway role. The verification itself is gateway/oidc.py; these are its settings.
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
