"""Admin API authentication: JWT bearer tokens with a pinned algorithm, issuer, audience and a role claim.

HS256 uses a shared secret from an env var; RS256/ES256 verify with a public key file. The algorithm is fixed
by the policy file, so `alg: none` and algorithm switching (an HS256 token signed with the RSA public key)
are rejected by construction. With `admin.oidc`, tokens whose `iss` is the OpenID provider's are verified with
the provider's keys (gateway/oidc.py) and their role comes from a mapped claim; both kinds may be accepted at
once (the provider for people, the shared secret for automation or as a break-glass).

Every failure is a 401 with code invalid_admin_token whose message names the problem (expired, not yet valid,
wrong audience, untrusted issuer, unknown key); the token never appears in a message or log.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import jwt

from gateway.oidc import IssuerKeys
from policies.config import Admin
from policies.errors import AuthenticationFailed, PermissionDenied, StateUnavailable
from policies.keys import TEAM_NAME as TEAM_NAME_PATTERN
from policies.config.oidc import AdminOidc, RoleGrant

# admin: everything; operator: reads, and changes to live traffic (variant weights), never keys; viewer: reads
ROLES = ("admin", "operator", "viewer")
# team_admin: the keys of the one team its `team` claim names, and that team's usage; only on routes that scope
# it to that team (opt={"team": True}: gateway/admin/scope.py)
TEAM_ADMIN = "team_admin"
TEAM_NAME = re.compile(TEAM_NAME_PATTERN)
INVALID = "missing or invalid admin token"
MAX_TOKEN = 8192


class AdminAuth:
    def __init__(self, config: Admin) -> None:
        self.config = config
        self.key = verification_key(config)
        self.oidc = IssuerKeys(config.oidc) if config.oidc is not None else None

    async def check(self, authorization: str | None, write: bool, operator: bool = False,
                    team_admin: bool = False) -> dict[str, Any]:
        """The token's claims, with `role` (and `team` for a team admin) as this gateway reads them, when the
        token is valid and its role may do this (write: change state; `operator`: a change an operator token may
        make too; `team_admin`: a route that scopes a team admin to their team)."""
        if self.key is None and self.oidc is None:
            raise StateUnavailable(
                f"the admin API is not configured: set {self.config.jwt_secret_env} (at least {MIN_SECRET}"
                " characters), admin.jwt_public_key_file or admin.oidc",
                code="admin_not_configured",
            )
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN:
            raise refused(INVALID)
        try:
            issuer = jwt.decode(token, options={"verify_signature": False}).get("iss")
            header = jwt.get_unverified_header(token)
        except Exception:  # noqa: BLE001 -- not a JWT at all, whatever PyJWT raises
            raise refused("the admin token is not a well-formed JWT") from None
        oidc = self.config.oidc
        if self.oidc is not None and oidc is not None and issuer == oidc.issuer:
            claims = await self.provider_claims(token, header, oidc)
        elif self.key is not None and issuer == self.config.issuer:
            claims = self.own_claims(token)
        else:
            raise refused("the admin token's issuer (iss) is not one this gateway trusts")
        may(claims["role"], write, operator, team_admin)
        return claims

    def own_claims(self, token: str) -> dict[str, Any]:
        """A token signed with the configured secret or key pair (HS256, RS256, ES256)."""
        assert self.key is not None  # check() comes here only when there is one
        try:
            claims = jwt.decode(token, self.key, algorithms=[self.config.jwt_algorithm],
                                audience=self.config.audience, issuer=self.config.issuer,
                                leeway=self.config.leeway_seconds, options={"require": ["exp", "iss", "aud", "role"]})
        except Exception as exc:  # noqa: BLE001 -- any malformed, forged, expired or mis-addressed token
            raise refused(problem(exc, self.config.audience)) from None
        role, team = claims.get("role"), claims.pop("team", None)
        if role == TEAM_ADMIN and isinstance(team, str) and TEAM_NAME.fullmatch(team):
            return {**claims, "team": team}
        if role not in ROLES:
            raise refused("the admin token's role is not one of " + ", ".join((*ROLES, TEAM_ADMIN)))
        return claims

    async def provider_claims(self, token: str, header: dict[str, Any], oidc: AdminOidc) -> dict[str, Any]:
        """A token of the OpenID provider: its key from the provider's JWKS, its role from the mapped claim."""
        kid = header.get("kid")
        if not isinstance(kid, str) or not 0 < len(kid) <= 256:
            raise refused("the admin token names no signing key (kid)")
        assert self.oidc is not None
        try:
            key = await self.oidc.key(kid)
        except KeyError as exc:
            raise refused(str(exc.args[0])) from None
        try:
            claims = jwt.decode(token, key, algorithms=list(oidc.algorithms), audience=oidc.audience,
                                issuer=oidc.issuer, leeway=self.config.leeway_seconds,
                                options={"require": ["exp", "iss", "aud", "sub"]})
        except Exception as exc:  # noqa: BLE001 -- as above: every bad token is a 401, never a 500
            raise refused(problem(exc, oidc.audience)) from None
        claims.pop("team", None)  # a team comes only from the mapping below, never from the provider's claims
        grant = role_of(claims, oidc)
        if grant is None:
            raise PermissionDenied(f"no gateway role is mapped to this token's {oidc.claim} (admin.oidc.roles)",
                                   code="no_admin_role")
        claims["role"] = grant.role
        if grant.team is not None:
            claims["team"] = grant.team
        return claims

    async def close(self) -> None:
        if self.oidc is not None:
            await self.oidc.close()


RANK = {"admin": 0, "operator": 1, TEAM_ADMIN: 2, "viewer": 3}
MAX_CLAIM_VALUES = 1000


def role_of(claims: dict[str, Any], oidc: AdminOidc) -> RoleGrant | None:
    """The strongest role mapped to the claim's values (admin, operator, team_admin, viewer); between two teams
    the first the policy lists."""
    value: object = claims
    for part in oidc.claim.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    held = {v for v in values[:MAX_CLAIM_VALUES] if isinstance(v, str)}
    grants = [grant for name, grant in oidc.roles.items() if name in held]
    return min(grants, key=lambda g: RANK[g.role], default=None)


def may(role: str, write: bool, operator: bool, team_admin: bool) -> None:
    if role == TEAM_ADMIN:
        if not team_admin:
            raise PermissionDenied("a team admin token may act only on its own team", code="team_admin_token")
        return
    if write and role != "admin" and not (operator and role == "operator"):
        raise PermissionDenied(f"this admin token may not change this (role {role})", code="read_only_token")


def refused(message: str) -> AuthenticationFailed:
    return AuthenticationFailed(message, code="invalid_admin_token")


def problem(exc: Exception, audience: str) -> str:
    """What is wrong with a token, named without repeating any of it."""
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "the admin token has expired"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "the admin token is not valid yet (nbf or iat in the future)"
    if isinstance(exc, jwt.InvalidAudienceError):
        return f"the admin token is not addressed to this gateway (audience {audience})"
    if isinstance(exc, jwt.InvalidIssuerError):
        return "the admin token's issuer (iss) is not one this gateway trusts"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"the admin token has no {exc.claim} claim"
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return "the admin token's algorithm is not the one configured"
    if isinstance(exc, jwt.InvalidSignatureError):
        return "the admin token's signature does not verify"
    return INVALID


MIN_SECRET = 32  # bytes of an HS256 secret; shorter ones are guessable offline from any token


def verification_key(config: Admin) -> str | bytes | None:
    if config.jwt_algorithm == "HS256":
        secret = os.environ.get(config.jwt_secret_env, "")
        return secret if len(secret.encode()) >= MIN_SECRET else None
    assert config.jwt_public_key_file is not None  # the policy requires it with RS256/ES256
    return Path(config.jwt_public_key_file).read_bytes()


def mint_token(config: Admin, ttl_seconds: float, role: str = "admin", subject: str = "admin",
               private_key: bytes | None = None, secret: str | None = None, team: str | None = None) -> str:
    """A token this gateway accepts: HS256 with `secret` (default: the configured env var), else `private_key`.
    A team_admin token names its `team`."""
    if role not in (*ROLES, TEAM_ADMIN):
        raise ValueError(f"role must be one of {', '.join((*ROLES, TEAM_ADMIN))}")
    if (role == TEAM_ADMIN) != (team is not None) or (team is not None and not TEAM_NAME.match(team)):
        raise ValueError("a team_admin token needs --team (a team's name), and only it takes one")
    if config.jwt_algorithm == "HS256":
        text = secret if secret is not None else os.environ.get(config.jwt_secret_env, "")
        if len(text.encode()) < MIN_SECRET:
            raise ValueError(f"set {config.jwt_secret_env} to the admin secret (at least {MIN_SECRET} characters)")
        key: str | bytes = text
    else:
        if private_key is None:
            raise ValueError(f"{config.jwt_algorithm} tokens need --private-key-file")
        key = private_key
    now = int(time.time())
    claims = {"iss": config.issuer, "aud": config.audience, "sub": subject, "role": role, "iat": now,
              "nbf": now, "exp": now + int(ttl_seconds), **({"team": team} if team else {})}
    return jwt.encode(claims, key, algorithm=config.jwt_algorithm)
