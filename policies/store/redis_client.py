"""How the gateway reaches Redis: one server, a primary watched by Sentinel, or a Cluster.

Each is redis-py's own client (`redis.asyncio.Redis`, `redis.asyncio.sentinel`, `redis.asyncio.cluster`), so
failover is theirs: a Sentinel pool asks the sentinels for the primary on every new connection and drops
connections to a demoted one (READONLY); a Cluster client re-reads the slot map when a node stops answering or
answers MOVED. What this module adds is one address form for the three and the same bounded timeouts for all.

    redis://host:6379/0               one server (rediss:// over TLS); a password in the URL is allowed
    redis+sentinel://h1:26379,h2:26379/mymaster[/db]
                                      ask these sentinels where `mymaster`'s primary is
    redis+cluster://h1:6379,h2:6379   startup nodes of a Cluster (one reachable node is enough to start)
    rediss+sentinel://, rediss+cluster://   the same, every connection over TLS

Passwords travel beside the address (`password`, `sentinel_password`), never inside a sentinel or cluster
address, so the address can be logged; errors this module raises name the mode, never the address's secrets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

STANDALONE, SENTINEL, CLUSTER = "standalone", "sentinel", "cluster"
SCHEMES = {
    "redis": (STANDALONE, False), "rediss": (STANDALONE, True),
    "redis+sentinel": (SENTINEL, False), "rediss+sentinel": (SENTINEL, True),
    "redis+cluster": (CLUSTER, False), "rediss+cluster": (CLUSTER, True),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Certificates for TLS connections (paths, e.g. a mounted Secret); None means the system's CAs."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"ssl_ca_certs": self.ca_file, "ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}


@dataclass(frozen=True, slots=True)
class Target:
    mode: str
    tls: bool
    url: str = ""  # standalone
    addresses: tuple[tuple[str, int], ...] = ()  # sentinels, or cluster startup nodes
    master_name: str = ""
    db: int = 0


def parse(url: str) -> Target:
    """The Target an address names; ValueError (without the address) when it is not one of the forms above."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES or not rest:
        raise ValueError(f"a redis address must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    mode, tls = SCHEMES[scheme]
    if mode == STANDALONE:
        return Target(mode, tls, url=url)
    hosts, _, path = rest.partition("/")
    if "@" in hosts:
        raise ValueError(f"a {mode} address carries no credentials: pass the password separately")
    addresses = tuple(host_port(item) for item in hosts.split(",") if item)
    if not addresses:
        raise ValueError(f"a {mode} address needs at least one host:port")
    parts = [p for p in path.split("/") if p]
    if mode == CLUSTER:
        if parts:
            raise ValueError("a cluster address has no path: a Cluster has one database")
        return Target(mode, tls, addresses=addresses)
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("a sentinel address ends in /<master name>[/<db>]")
    return Target(mode, tls, addresses=addresses, master_name=parts[0], db=int(parts[1]) if len(parts) == 2 else 0)


def host_port(item: str) -> tuple[str, int]:
    parts = urlsplit("//" + item)
    if not parts.hostname or parts.port is None:
        raise ValueError("each address is host:port")
    return parts.hostname, parts.port


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (finds the primary per connection) with a bounded size: a caller past the bound waits
    for a free connection, counted against its deadline, rather than opening connections without end."""


def connect(
    url: str,
    *,
    password: str | None = None,
    sentinel_password: str | None = None,
    tls_files: TLSFiles | None = None,
    timeout: float = 1.0,
    deadline: float = 2.5,
    max_connections: int = 64,
) -> Redis | RedisCluster:
    """A client for the address. Sockets time out after `timeout`, a failed command is retried once on a fresh
    connection (which is how pools heal after a restart or a failover), and waiting for a pooled connection
    counts against `deadline`. It connects lazily."""
    target = parse(url)
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": timeout,
        "socket_timeout": timeout,
        "retry": Retry(NoBackoff(), 1),
    }
    tls = (tls_files or TLSFiles()).kwargs() if target.tls else {}
    if target.mode == STANDALONE:
        extra = {k: v for k, v in tls.items() if v is not None}
        pool = BlockingConnectionPool.from_url(
            url, password=password, max_connections=max_connections, timeout=deadline, **common, **extra,
        )  # a password in the URL wins (the policy refuses both at once)
        return Redis.from_pool(pool)
    if target.mode == SENTINEL:
        sentinel_tls = {"ssl": True, **tls} if target.tls else {}
        sentinels = Sentinel(
            list(target.addresses),
            sentinel_kwargs={"password": sentinel_password, "socket_connect_timeout": timeout,
                             "socket_timeout": timeout, **sentinel_tls},
        )
        return cast(Redis, sentinels.master_for(
            target.master_name, connection_pool_class=BlockingSentinelPool, password=password, db=target.db,
            max_connections=max_connections, timeout=deadline, check_connection=False,
            **({"ssl": True} | tls if target.tls else {}), **common,
        ))
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.addresses],
        password=password, max_connections=max_connections, ssl=target.tls, **tls, **common,
    )  # the one retry comes after a re-read of the slot map, so it finds a promoted replica
