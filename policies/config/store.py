"""Where the shared state lives: SQLite, or Redis (one server, Sentinel or Cluster) with its secrets."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from policies.config.base import EnvName, HostPort, Strict
from policies.config.env_secrets import secret


class RedisSentinel(Strict):
    """Ask these sentinels where the primary of `master_name` is; they move the gateway on at a failover."""

    addresses: list[HostPort] = Field(min_length=1)  # the sentinels, host:port (26379 by convention)
    master_name: str = Field("mymaster", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    db: int = Field(0, ge=0, le=15)
    password_env: EnvName | None = None  # the sentinels' own password (requirepass on the sentinels), if any
    password_file: str | None = None

    def password(self) -> str | None:
        return secret("store.sentinel.password", self.password_env, self.password_file)


class RedisClusterNodes(Strict):
    nodes: list[HostPort] = Field(min_length=1)  # startup nodes, host:port; any one reachable is enough


class Store(Strict):
    kind: Literal["sqlite", "redis"] = "sqlite"
    path: str = "llm-gateway.db"  # sqlite: the database file
    url: str = "redis://127.0.0.1:6379/0"  # redis: one server (rediss:// for TLS)
    sentinel: RedisSentinel | None = None  # redis: a primary watched by Sentinel (instead of url)
    cluster: RedisClusterNodes | None = None  # redis: a Redis Cluster (instead of url)
    prefix: str = Field("llmgw:", min_length=1, max_length=64, pattern=r"^[^{}]+$")  # redis: namespace of every key
    # redis: the server's password from an env var or a file (a mounted Secret), so the policy file (a
    # ConfigMap) never carries it
    password_env: EnvName | None = None
    password_file: str | None = None
    tls: bool = False  # redis: TLS to sentinels and servers (a url uses rediss:// instead)
    tls_ca_file: str | None = None  # redis: CA bundle for TLS (default: the system's)
    tls_cert_file: str | None = None  # redis: client certificate, for servers that ask for one
    tls_key_file: str | None = None

    @model_validator(mode="after")
    def one_password(self) -> Store:
        if self.password_env and self.password_file:
            raise ValueError("give password_env or password_file, not both")
        if (self.password_env or self.password_file) and urlsplit(self.url).password is not None:
            raise ValueError("url carries a password and password_env names one too: keep it in the env var only")
        return self

    @model_validator(mode="after")
    def one_address(self) -> Store:
        if self.sentinel and self.cluster:
            raise ValueError("give sentinel or cluster, not both")
        if (self.sentinel or self.cluster) and "url" in self.model_fields_set:
            raise ValueError("give url, sentinel or cluster: one way to reach Redis")
        if self.tls and "url" in self.model_fields_set:
            raise ValueError("tls is for sentinel and cluster; a url says rediss:// instead")
        return self

    def password(self) -> str | None:
        """The Redis password (None when none is configured)."""
        return secret("store.password", self.password_env, self.password_file)

    def redis_url(self) -> str:
        """The address policies.store.redis_client reads; it never holds a password from the env or a file."""
        scheme = "rediss" if self.tls else "redis"
        if self.sentinel:
            return f"{scheme}+sentinel://{','.join(self.sentinel.addresses)}/{self.sentinel.master_name}/" \
                   f"{self.sentinel.db}"
        if self.cluster:
            return f"{scheme}+cluster://{','.join(self.cluster.nodes)}"
        return self.url
