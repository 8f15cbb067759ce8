"""Who may call and how much: API key checks, the admin API's tokens, rate limits and the network."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.config.audit import AuditSettings
from policies.config.base import Seconds, Strict
from policies.config.oidc import AdminOidc


class Auth(Strict):
    cache_seconds: float = Field(5.0, ge=0, le=300)  # verified keys are cached this long; revocation bound
    # while the store is unreachable (an outage, a failover), a key this process verified within this long
    # still authenticates; a change made meanwhile reaches it when the store is back. 0: answer 503 instead
    stale_seconds: float = Field(300.0, ge=0, le=86400)


class Admin(Strict):
    jwt_algorithm: Literal["HS256", "RS256", "ES256"] = "HS256"
    jwt_secret_env: str = "LLM_GATEWAY_ADMIN_SECRET"  # HS256: the env var holding the shared secret
    jwt_public_key_file: str | None = None  # RS256/ES256: PEM public key that verifies tokens
    issuer: str = "llm-gateway"
    audience: str = "llm-gateway-admin"
    leeway_seconds: float = Field(5.0, ge=0, le=300)
    oidc: AdminOidc | None = None  # admins from an OpenID provider (policies/config/oidc.py)
    audit: AuditSettings = AuditSettings()  # retention of the audit log (policies/config/audit.py)

    @model_validator(mode="after")
    def key_for_algorithm(self) -> Admin:
        if self.jwt_algorithm != "HS256" and not self.jwt_public_key_file:
            raise ValueError(f"jwt_public_key_file is required with {self.jwt_algorithm}")
        return self


FailureMode = Literal["fail_open", "fail_closed"]


class LimitValues(Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)


class OnStoreFailure(Strict):
    """Per limit kind, what happens while the shared store (Redis) is unreachable."""

    requests: FailureMode = "fail_open"
    tokens: FailureMode = "fail_open"
    concurrency: FailureMode = "fail_closed"


class RateLimits(Strict):
    default_max_tokens: int = Field(1024, ge=1)  # reserved when a request sets no max_tokens
    lease_seconds: Seconds = 3600.0  # a concurrency slot not released by then is presumed lost
    on_store_failure: OnStoreFailure = OnStoreFailure()


PRIVATE_CIDRS = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "::1/128", "fc00::/7"]


class Network(Strict):
    """Where traffic may go (egress) and come from (ingress)."""

    private_cidrs: list[str] = PRIVATE_CIDRS  # every owned backend must resolve only inside these
    allowed_client_cidrs: list[str] | None = None  # ingress allowlist for every key; None: any client
    trusted_proxies: list[str] = []  # X-Forwarded-For is honoured only from these peers

    @field_validator("private_cidrs", "allowed_client_cidrs", "trusted_proxies")
    @classmethod
    def cidrs(cls, value: list[str] | None) -> list[str] | None:
        from policies.keys import normalize_cidrs

        return normalize_cidrs(value)
