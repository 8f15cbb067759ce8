"""Admin API authentication: JWT bearer tokens with a pinned algorithm, issuer, audience and a role claim.

HS256 uses a shared secret from an env var; RS256/ES256 verify with a public key file. The algorithm is fixed
by the policy file, so `alg: none` and algorithm switching (an HS256 token signed with the RSA public key)
are rejected by construction. Every failure is the same 401; the token never appears in a message or log.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import jwt

from policies.config import Admin
from policies.errors import AuthenticationFailed, PermissionDenied, StateUnavailable
from policies.keys import TEAM_NAME as TEAM_NAME_PATTERN

# admin: everything; operator: reads, and changes to live traffic (variant weights), never keys; viewer: reads;
# team_admin: the keys of the one team its `team` claim names, and that team's usage (gateway/admin_routes.py)
ROLES = ("admin", "operator", "viewer", "team_admin")
TEAM_NAME = re.compile(TEAM_NAME_PATTERN)
INVALID = "missing or invalid admin token"
MAX_TOKEN = 8192


class AdminAuth:
    def __init__(self, config: Admin) -> None:
        self.config = config
        self.key = verification_key(config)

    def check(self, authorization: str | None, write: bool, operator: bool = False) -> dict:
        """The token's claims, when it is valid and its role may do this (write: change state; `operator`: a
        change an operator token may make too)."""
        if self.key is None:
            raise StateUnavailable(
                f"the admin API is not configured: set {self.config.jwt_secret_env} (at least {MIN_SECRET}"
                " characters) or admin.jwt_public_key_file",
                code="admin_not_configured",
            )
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN:
            raise AuthenticationFailed(INVALID, code="invalid_admin_token")
        try:
            claims = jwt.decode(
                token.strip(),
                self.key,
                algorithms=[self.config.jwt_algorithm],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=self.config.leeway_seconds,
                options={"require": ["exp", "iss", "aud", "role"]},
            )
        except Exception:  # any malformed, forged, expired or mis-addressed token: PyJWTError and friends
            raise AuthenticationFailed(INVALID, code="invalid_admin_token") from None
        role = claims.get("role")
        if role not in ROLES:
            raise AuthenticationFailed(INVALID, code="invalid_admin_token")
        if role == "team_admin" and not (isinstance(claims.get("team"), str) and TEAM_NAME.match(claims["team"])):
            raise AuthenticationFailed(INVALID, code="invalid_admin_token")  # a team admin of no team is no one
        if write and role not in ("admin", "team_admin") and not (operator and role == "operator"):
            raise PermissionDenied(f"this admin token may not change this (role {role})", code="read_only_token")
        return claims


MIN_SECRET = 32  # bytes of an HS256 secret; shorter ones are guessable offline from any token


def verification_key(config: Admin) -> str | bytes | None:
    if config.jwt_algorithm == "HS256":
        secret = os.environ.get(config.jwt_secret_env, "")
        return secret if len(secret.encode()) >= MIN_SECRET else None
    return Path(config.jwt_public_key_file).read_bytes()


def mint_token(config: Admin, ttl_seconds: float, role: str = "admin", subject: str = "admin",
               private_key: bytes | None = None, secret: str | None = None, team: str | None = None) -> str:
    """A token this gateway accepts: HS256 with `secret` (default: the configured env var), else `private_key`.
    A team_admin token names its `team`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if (role == "team_admin") != (team is not None) or (team is not None and not TEAM_NAME.match(team)):
        raise ValueError("a team_admin token needs --team (a team's name), and only it takes one")
    if config.jwt_algorithm == "HS256":
        key: str | bytes | None = secret if secret is not None else os.environ.get(config.jwt_secret_env, "")
        if len(key.encode()) < MIN_SECRET:
            raise ValueError(f"set {config.jwt_secret_env} to the admin secret (at least {MIN_SECRET} characters)")
    else:
        if private_key is None:
            raise ValueError(f"{config.jwt_algorithm} tokens need --private-key-file")
        key = private_key
    now = int(time.time())
    claims = {"iss": config.issuer, "aud": config.audience, "sub": subject, "role": role, "iat": now,
              "nbf": now, "exp": now + int(ttl_seconds), **({"team": team} if team else {})}
    return jwt.encode(claims, key, algorithm=config.jwt_algorithm)
