"""The policy file: one YAML document that says which models exist and where they are served.

Validated by pydantic with unknown keys rejected, so a typo is an error at load time rather than a setting
that silently does nothing. `load_policy` turns every problem into one `PolicyError` whose lines name the
offending field (`models[0].backends[1].url: ...`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from backends.replicas import group_name
from policies.audit_settings import AuditSettings
from policies.console_settings import Console
from policies.oidc_settings import AdminOidc

NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"
Seconds = Annotated[float, Field(gt=0, le=86400)]


def http_url(url: str) -> str:
    """A base URL the gateway may call: http(s), a host, and nothing that belongs elsewhere (credentials)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host, e.g. http://10.0.0.5:8000")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("must not carry a query, fragment or credentials")
    return url.rstrip("/")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)


class Timeouts(Strict):
    connect: Seconds = 5.0
    read: Seconds = 600.0
    write: Seconds = 30.0
    health_check: Seconds = 2.0


class UpstreamLimits(Strict):
    """What one answer of a backend or rented provider may be (the bounded edge, outbound): past a bound the
    client gets a 502 (mid-stream, a final error event) naming it, and the gateway holds no more than it."""

    max_header_bytes: int = Field(64 * 1024, ge=4096, le=16 * 1024**2)  # status line and headers
    header_seconds: Seconds = 30.0  # from the first byte of an answer's head to its end (a dripped head)
    max_body_bytes: int = Field(32 * 1024**2, ge=64 * 1024, le=4 * 1024**3)  # a non-streamed answer, read whole
    max_event_bytes: int = Field(8 * 1024**2, ge=64 * 1024, le=1024**3)  # one event of a streamed answer


class Health(Strict):
    interval: Seconds = 5.0
    failure_threshold: int = Field(1, ge=1, le=100)
    backoff_initial: Seconds = 1.0
    backoff_max: Seconds = 60.0


class Server(Strict):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1024**3)
    # the audio routes' multipart uploads, streamed through to the replica (OpenAI's own limit is 25 MB)
    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1024, le=16 * 1024**3)
    # SIGTERM (a rolling update) first drains: /ready answers 503 while every route keeps serving this long,
    # so the Service stops routing here before the listener closes. 0: close at once (a process nobody
    # reaches through a Service); the Helm chart sets it with shutdown_timeout from one value.
    drain_seconds: float = Field(0.0, ge=0, le=3600)
    # after the drain: how long requests in flight (streams) may take to finish before they are cut
    shutdown_timeout: Seconds = 30.0
    # The client side of the bounded edge (gateway/edge.py). The request line and headers: 431 beyond (Envoy's
    # default is 60 KiB, nginx's 4 x 8 KiB; an API request's head is well under 8 KiB).
    max_header_bytes: int = Field(64 * 1024, ge=4096, le=1024**2)
    # from a new connection's accept, or a request's first byte, to the end of its headers: 408 beyond (slowloris)
    header_timeout: Seconds = 30.0
    # the longest wait for the next bytes of a request body (nginx's client_body_timeout is 60 s): 408 beyond
    body_timeout: Seconds = 60.0
    # the least average rate of a body once it has taken 5 s (1 KiB/s: a 25 MB upload may take ~7 h; one byte
    # per half second is cut after 5 s): 408 beyond
    body_min_rate: int = Field(1024, ge=0, le=1024**3)
    # idle keep-alive: longer than the load balancers in front (AWS ALB 60 s, nginx 60-75 s), so that the balancer
    # closes an idle connection first; a server that closes first races the balancer's reuse of it (the 502s and
    # "server disconnected" that a 5 s keep-alive gives about once in a few thousand requests)
    keepalive_seconds: Seconds = 90.0
    # client connections at once; beyond it the longest-idle one makes room, and only when all serve requests a
    # new one gets a fast 503 (Retry-After: 1). Also kept under half the process's file limit (see gateway/edge.py).
    max_connections: int = Field(4096, ge=1, le=1_000_000)


class PluginRef(Strict):
    """One routing plugin in a profile: its registered name, its weight (scorers) and its typed params."""

    name: str
    weight: float = Field(1.0, gt=0, le=1000)
    params: dict[str, Any] = {}


class RoutingProfile(Strict):
    """filters -> weighted scorers -> picker (policies/routing/ documents each plugin and its params)."""

    filters: list[PluginRef] = []
    scorers: list[PluginRef] = []
    picker: str = "max-score"

    @model_validator(mode="after")
    def known_plugins(self) -> RoutingProfile:
        from policies.routing.registry import FILTERS, PICKERS, SCORERS

        for kind, refs, registry in (("filter", self.filters, FILTERS), ("scorer", self.scorers, SCORERS)):
            for ref in refs:
                plugin = registry.get(ref.name)
                if plugin is None:
                    raise ValueError(f"unknown {kind} {ref.name!r}; known: {', '.join(sorted(registry))}")
                try:
                    plugin.Params.model_validate(ref.params)
                except ValidationError as exc:
                    problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                         for e in exc.errors(include_url=False))
                    raise ValueError(f"{kind} {ref.name}: params: {problems}") from None
        if self.picker not in PICKERS:
            raise ValueError(f"unknown picker {self.picker!r}; known: {', '.join(sorted(PICKERS))}")
        return self


def _ref(name: str, weight: float = 1.0, **params: Any) -> PluginRef:
    return PluginRef(name=name, weight=weight, params=params)


# Profiles every policy has (a policy's own `routing.profiles` may add more or replace these by name).
BUILTIN_PROFILES: dict[str, RoutingProfile] = {
    # the prompt's cached prefix first, unless that replica is loaded past the guard; then vLLM's own queue
    "default": RoutingProfile(scorers=[_ref("prefix-affinity", 4), _ref("vllm-queue", 2), _ref("least-in-flight")]),
    "least-in-flight": RoutingProfile(scorers=[_ref("least-in-flight")]),
    "vllm-queue": RoutingProfile(scorers=[_ref("vllm-queue", 2), _ref("least-in-flight")]),
    "prefix-affinity": RoutingProfile(scorers=[_ref("prefix-affinity", 4), _ref("vllm-queue", 2),
                                               _ref("least-in-flight")]),
    "session-affinity": RoutingProfile(scorers=[_ref("session-affinity", 4), _ref("vllm-queue", 2),
                                                _ref("least-in-flight")]),
    "random": RoutingProfile(picker="random"),
}


class Scrape(Strict):
    """Polling each owned replica's vLLM /metrics (load, KV cache, prefix cache) for routing."""

    enabled: bool = True
    interval: float = Field(0.25, ge=0.05, le=60)  # seconds between scrapes of every replica
    timeout: float = Field(1.0, gt=0, le=60)  # one scrape; a slow or failed one leaves the stats to go stale
    stale_after: float | None = Field(None, gt=0, le=600)  # older stats are ignored (default: 4 x interval, >= 1 s)
    # one scrape's body; vLLM's exposition is ~50 KB (more with many LoRA adapters): past this it is dropped
    max_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, le=256 * 1024**2)


class Routing(Strict):
    scrape: Scrape = Scrape()
    default_profile: str = Field("default", pattern=NAME)  # for models that name none
    profiles: dict[Annotated[str, Field(pattern=NAME)], RoutingProfile] = {}

    def profile(self, name: str) -> RoutingProfile:
        return self.profiles.get(name) or BUILTIN_PROFILES[name]

    def known(self) -> set[str]:
        return set(BUILTIN_PROFILES) | set(self.profiles)

    @model_validator(mode="after")
    def default_exists(self) -> Routing:
        if self.default_profile not in self.known():
            raise ValueError(f"default_profile {self.default_profile!r} is not a profile; known: "
                             f"{', '.join(sorted(self.known()))}")
        return self


EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
ZMQ_TCP = r"^tcp://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\]|\*):[0-9]{1,5}$"
HostPort = Annotated[str, Field(pattern=r"^[A-Za-z0-9.:\[\]_-]+:[0-9]{1,5}$")]


def secret(field: str, env: str | None, file: str | None) -> str | None:
    """A password from the env var `env` or the file `file` (a mounted Secret; one trailing newline dropped).
    Named but missing or empty is an error that names the variable or file, never a silent try without it."""
    if env:
        import os

        value = os.environ.get(env)
        if not value:
            raise PolicyError(f"{field}_env: the environment variable {env} is not set")
        return value
    if file:
        try:
            value = Path(file).read_text().removesuffix("\n")
        except OSError as exc:
            raise PolicyError(f"{field}_file: cannot read {file} ({type(exc).__name__})") from None
        if not value:
            raise PolicyError(f"{field}_file: {file} is empty")
        return value
    return None


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
    oidc: AdminOidc | None = None  # admins from an OpenID provider (policies/oidc_settings.py)
    audit: AuditSettings = AuditSettings()  # retention of the audit log (policies/audit_settings.py)

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


class Price(Strict):
    input: float = Field(0.0, ge=0)  # currency units per million prompt tokens
    output: float = Field(0.0, ge=0)  # per million completion tokens


class Provider(Strict):
    """A rented OpenAI-compatible API: the only public egress, declared here and nowhere else."""

    name: str = Field(pattern=NAME)
    base_url: str  # e.g. https://api.openai.com/v1 (including the /v1)
    api_key_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")  # the key is read from this env var
    models: dict[str, str] = Field(min_length=1)  # our public model name -> the provider's model
    price_per_million_tokens: Price = Price()
    timeout: Seconds = 120.0
    allow_private_address: bool = False  # only for test stand-ins on loopback: say so explicitly
    # pass the trace context (`traceparent`, `tracestate`) to this provider: off, since a public API has no
    # business with a private client's trace ids or vendor state
    send_trace_context: bool = False

    @field_validator("base_url")
    @classmethod
    def valid_url(cls, url: str) -> str:
        return http_url(url)


class Overflow(Strict):
    """When an owned model may spill to a rented provider (only for keys whose data policy allows it)."""

    provider: str
    when_wait_exceeds: Seconds = 2.0  # every owned replica at its cap and the expected wait is longer
    when_unavailable: bool = True  # no owned replica is healthy


class Adaptive(Strict):
    """A limit that follows the live knee: it moves between `floor` and the backend's measured `cap`."""

    floor: int = Field(1, ge=1)
    target_ttft: Seconds  # time to first token the backend should keep; slower answers shrink the limit


class OwnedCost(Strict):
    """What an owned backend costs while it exists, busy or idle: GPU rent or amortised purchase, plus power."""

    per_hour: float = Field(ge=0, le=1_000_000)  # currency units per hour
    power_kw: float | None = Field(None, ge=0, le=10_000)  # average draw; priced at ledger.power_price_per_kwh


class KVEvents(Strict):
    """vLLM's KV cache events for this backend (`--kv-events-config`), read by the precise-prefix scorer.

    Exactly one of: `bind`, an address this gateway binds, with vLLM started with that same concrete address (it
    then connects to the gateway; one gateway process per address); or `connect`, the address of a vLLM started
    with `tcp://*:PORT` (it binds; any number of gateways connect)."""

    bind: str | None = Field(None, pattern=ZMQ_TCP)
    connect: str | None = Field(None, pattern=ZMQ_TCP)
    topic: str = Field("kv", pattern=r"^[A-Za-z0-9._-]{0,64}$")  # vLLM's `topic` (prefix-matched by ZMQ)
    # vLLM's `replay_endpoint` (vLLM binds it): on a gap in the events the gateway asks there for the lost ones
    # instead of forgetting the replica's blocks; null: a gap clears them
    replay: str | None = Field(None, pattern=ZMQ_TCP)
    # one message (one batch of events); vLLM's are a few KB: a larger one is dropped with its connection
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, le=256 * 1024**2)
    # blocks remembered for this replica (~200 bytes each; 131,072 blocks of 16 tokens cover a 2M-token cache):
    # past it the oldest stored are forgotten
    max_blocks: int = Field(131072, ge=16, le=10_000_000)

    @model_validator(mode="after")
    def one_address(self) -> KVEvents:
        if (self.bind is None) == (self.connect is None):
            raise ValueError("kv_events needs exactly one of `bind` or `connect`")
        return self


class Backend(Strict):
    url: str
    # vLLM's --scheduling-policy on this backend: with "priority" the gateway sends each request's class as
    # vLLM's `priority` field (lower is served first)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    name: str | None = Field(None, pattern=NAME)
    served_name: str | None = Field(None, pattern=NAME)
    cap: int | None = Field(None, ge=1, le=100_000)  # most requests in flight to it: its measured knee
    # the path probed for health: vLLM serves /health; KServe's Hugging Face runtime only /v1/models/<name>
    health_path: str = Field("/health", pattern=r"^/[A-Za-z0-9._~:@!$&'()*+,;=/%-]*$", max_length=256)
    adaptive: Adaptive | None = None  # optional: track the live knee below `cap` from observed TTFT
    cost: OwnedCost | None = None  # optional: for the own-vs-rent report (policies/ledger/report.py)
    kv_events: KVEvents | None = None  # optional: vLLM publishes its KV cache events (precise prefix routing)

    @model_validator(mode="after")
    def adaptive_needs_cap(self) -> Backend:
        if self.adaptive is not None and (self.cap is None or self.adaptive.floor > self.cap):
            raise ValueError("adaptive needs a cap (its upper bound) that is at least adaptive.floor")
        return self

    @field_validator("url")
    @classmethod
    def valid_url(cls, url: str) -> str:
        return http_url(url)


class Queue(Strict):
    """Where requests wait while every replica of the model is at its cap."""

    max_depth: int = Field(256, ge=0, le=100_000)  # more waiting than this: 429 at once
    max_wait: Seconds = 30.0  # waited this long: 429 with a Retry-After from the observed drain rate


class PriorityClass(Strict):
    """A class of traffic: waiting requests are served class by class (in the order the policy lists them),
    fairly across keys within a class."""

    name: str = Field(pattern=NAME)
    max_wait: Seconds | None = None  # its own bound on the wait for a slot (default: the model's queue.max_wait)
    vllm_priority: int = 0  # sent as vLLM's `priority` to backends with scheduling_policy: priority
    rent_first: bool = False  # a key allowed to rent spills to the rented provider rather than wait at all
    # the least fraction of freed slots this class gets while it waits, ahead of better classes (so nightly
    # batch work finishes under steady interactive load); 0: served only when no better class wants a slot,
    # which starves it whenever better classes alone fill the cap
    min_share: float = Field(0.0, ge=0, le=1)


class Priorities(Strict):
    default: str = Field("interactive", pattern=NAME)  # the class of a key that names none
    header: str = Field("x-priority-class", pattern=r"^[a-z0-9-]{1,64}$")  # where a permitted client picks one
    # a slot freed by a request while only worse classes wait is kept this long for its own class's next
    # request (a client sends its next call a moment after the last ends); 0: handed on at once
    hold: float = Field(0.05, ge=0, le=1)
    classes: list[PriorityClass] = Field([
        PriorityClass(name="interactive"),
        PriorityClass(name="batch", max_wait=300, vllm_priority=10, rent_first=True),
    ], min_length=1, max_length=16)

    @model_validator(mode="after")
    def known_default(self) -> Priorities:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("priority class names must be unique")
        if self.default not in names:
            raise ValueError(f"default {self.default!r} is not one of the classes: {', '.join(names)}")
        return self

    def named(self, name: str | None) -> PriorityClass | None:
        return next((c for c in self.classes if c.name == name), None)


class Caps(Strict):
    """Backend caps shared by every gateway replica (with the Redis store): slots are leases in Redis."""

    lease_seconds: Seconds = 15.0  # renewed every third of it; a dead gateway's slots come back after this
    poll_interval: float = Field(0.02, ge=0.001, le=5)  # how often a process with waiters retries the fleet
    # a process whose longest waiter (same class) arrived within this of another process's takes a free slot
    # itself instead of yielding it: strict order would hand each slot across processes, a refusal and a
    # wake-up apiece, which at hundreds of slots freed at once leaves the backend short for tens of ms
    fair_within: float = Field(0.05, ge=0, le=10)


DNS_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class Autoscaling(Strict):
    """The replicas a model needs at its knee, for an autoscaler to read (policies/scaling.py), and what its
    requests do while it has none (scale from zero). See the README's "Autoscaling" section."""

    # extra replicas asked for beyond the demand, as a fraction of it: a new replica takes minutes to start,
    # so the signal asks for one before the queue forms rather than once it has
    headroom: float = Field(0.1, ge=0, le=10)
    # a fall in demand is followed with this time constant (a rise at once): a lull between bursts does not
    # scale a replica away only to start it again; 0 follows the demand as it is
    smoothing_seconds: float = Field(60.0, ge=0, le=3600)
    # while no replica of the model can serve (all scaled away, or starting), requests wait this long for one
    # in the queue (within queue.max_depth); past it: 503 with Retry-After. About one vLLM cold start.
    cold_start_wait: Seconds = 300.0
    # the cap of one replica the signal divides by; default: discovery.cap, else the mean of the backends' caps
    replica_cap: int | None = Field(None, ge=1, le=100_000)


class Discovery(Strict):
    """Where a model's replicas are found in a cluster instead of a `backends:` list (backends/sources/).

    kubernetes: the ready endpoints of a Service's EndpointSlices; kserve: an InferenceService, while it is
    Ready, through the EndpointSlices of its predictor Service (`NAME-predictor`). Every endpoint gets the
    settings below; an endpoint outside network.private_cidrs is refused."""

    kind: Literal["kubernetes", "kserve"]
    namespace: str = Field(pattern=DNS_NAME, max_length=63)
    service: str | None = Field(None, pattern=DNS_NAME, max_length=63)  # kind kubernetes: the Service's name
    inference_service: str | None = Field(None, pattern=DNS_NAME, max_length=63)  # kind kserve
    port: int | str | None = None  # the EndpointSlice port (number or name); default: its first port
    scheme: Literal["http", "https"] = "http"
    cap: int | None = Field(None, ge=1, le=100_000)  # per endpoint, as a backend's cap
    health_path: str = Field("/health", pattern=r"^/[A-Za-z0-9._~:@!$&'()*+,;=/%-]*$", max_length=256)

    @model_validator(mode="after")
    def names_its_target(self) -> Discovery:
        if self.kind == "kubernetes" and (self.service is None or self.inference_service is not None):
            raise ValueError("kind kubernetes needs `service` (and no inference_service)")
        if self.kind == "kserve" and (self.inference_service is None or self.service is not None):
            raise ValueError("kind kserve needs `inference_service` (and no service)")
        return self


class KubernetesAccess(Strict):
    """How the gateway reaches the Kubernetes API for discovery: its service account, or a kubeconfig file;
    and how its watches notice a dead connection (backends/sources/watch.py). A change on the API server is
    applied within read_timeout + one backoff step + one list, even through a flow that died silently."""

    kubeconfig: str | None = None  # None: the in-cluster service account
    # no byte for this long on a list or a watch drops the connection; the API server sends a bookmark about
    # every 60 s on a watch that asks for them, so a healthy watch is never silent this long
    read_timeout: float = Field(90.0, ge=0.5, le=3600)
    connect_timeout: float = Field(10.0, ge=0.1, le=300)
    # a full list at least this often, whatever the watch says: the backstop for an event lost in transit
    relist_seconds: float = Field(300.0, ge=1, le=86400)
    backoff_initial: float = Field(0.5, ge=0.01, le=60)  # the first retry of a failed watch, doubled per failure
    backoff_max: float = Field(30.0, ge=0.1, le=3600)  # up to this (each pause jittered to 50-100% of it)


VARIANT = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class Variant(Strict):
    """One way of serving a model (a vLLM flag, a quantisation, a draft model): its own replicas, from a
    `backends` list or `discovery`, with their caps, and its share of the model's traffic."""

    name: str = Field(pattern=VARIANT)
    weight: float = Field(0.0, ge=0, le=1_000_000)  # relative to the other live ones; a shadow's: percent copied
    shadow: bool = False  # gets copies of sampled requests, never live traffic (its answers are never returned)
    served_name: str | None = Field(None, pattern=NAME)
    backends: list[Backend] = []
    discovery: Discovery | None = None

    @model_validator(mode="after")
    def backends_or_discovery(self) -> Variant:
        if bool(self.backends) == (self.discovery is not None):
            raise ValueError("a variant needs either a non-empty `backends` list or `discovery`, not both")
        return self


class Promotion(Strict):
    """Steps a candidate takes while its guard holds: its share of the model's traffic, in percent."""

    steps: list[Annotated[float, Field(gt=0, le=100)]] = Field(min_length=1)  # e.g. [5, 25, 50, 100]
    after_requests: int = Field(200, ge=1, le=10_000_000)  # the candidate's calls at a step before the next

    @field_validator("steps")
    @classmethod
    def rising(cls, steps: list[float]) -> list[float]:
        if steps != sorted(set(steps)):
            raise ValueError("steps must rise, e.g. [5, 25, 50, 100]")
        return steps


class Guard(Strict):
    """Each candidate variant against the baseline, over a sliding window (policies/variant_guard.py): a
    breach sets the candidate's weight to 0 at once. A limit that is null is not checked."""

    baseline: str | None = Field(None, pattern=VARIANT)  # default: the first variant that is not a shadow
    window_seconds: Seconds = 300.0
    min_samples: int = Field(50, ge=1, le=1_000_000)  # per side and signal before it is judged
    max_validity_drop: float | None = Field(0.02, ge=0, le=1)  # structured-output validity, in points
    max_error_increase: float | None = Field(0.01, ge=0, le=1)  # the variant's own faults, in points
    max_itl_ratio: float | None = Field(1.2, gt=1, le=100)  # inter-token latency p50 at comparable load
    max_ttft_ratio: float | None = Field(1.5, gt=1, le=100)  # time to first token p50 at comparable load
    min_agreement: float | None = Field(0.9, ge=0, le=1)  # shadow answers equal to the live one (temperature 0)
    promotion: Promotion | None = None


class Sticky(Strict):
    """What keeps one conversation on one variant (and its prefix cache): the value of a request header when
    the request has it, else the API key when `key` is true; a request with neither is assigned at random."""

    header: str | None = Field(None, pattern=r"^[a-z0-9-]{1,64}$")
    key: bool = False


class Model(Strict):
    name: str = Field(pattern=NAME)
    aliases: list[Annotated[str, Field(pattern=NAME)]] = []
    served_name: str | None = Field(None, pattern=NAME)
    limits: LimitValues | None = None  # the model's totals across every key
    queue: Queue = Queue()
    overflow: Overflow | None = None  # None: this model never leaves the cluster
    routing: str | None = Field(None, pattern=NAME)  # a routing profile's name (default: routing.default_profile)
    # the provider whose price the own-vs-rent report compares with (default: the overflow provider)
    rented_price_from: str | None = Field(None, pattern=NAME)
    backends: list[Backend] = []
    discovery: Discovery | None = None  # instead of backends: replicas found in the cluster, watched
    # instead of backends and discovery: named variants, each with its own replicas, split by weight
    variants: list[Variant] = []
    sticky: Sticky | None = None  # variants: keep a conversation on one (default: every request drawn anew)
    guard: Guard | None = None  # variants: compare candidates with the baseline and pull back a worse one
    autoscaling: Autoscaling | None = None  # the replica-count signal's settings and scale from zero

    @model_validator(mode="after")
    def backends_or_discovery(self) -> Model:
        if self.variants:
            if self.backends or self.discovery is not None:
                raise ValueError("a model with `variants` gives its replicas there, not in `backends`/`discovery`")
            names = [v.name for v in self.variants]
            if len(set(names)) != len(names):
                raise ValueError("variant names must be unique")
            if sum(v.weight for v in self.variants if not v.shadow) <= 0:
                raise ValueError("variants: at least one variant that is not a shadow needs a weight above 0")
            if any(v.shadow and v.weight > 100 for v in self.variants):
                raise ValueError("a shadow variant's weight is the percent of requests copied to it: at most 100")
            if self.guard and self.guard.baseline and self.guard.baseline not in names:
                raise ValueError(f"guard.baseline {self.guard.baseline!r} is not a variant of this model")
            # every owned backend of the model, in one list: the egress check, caps, cost and ledger read it
            flat = [b if b.name else b.model_copy(update={"name": f"{self.name}-{v.name}-{j}"})
                    for v in self.variants for j, b in enumerate(v.backends)]
            object.__setattr__(self, "backends", flat)  # frozen: set once, here, while validating
            return self
        if self.sticky is not None or self.guard is not None:
            raise ValueError("sticky and guard apply to variants; this model has none")
        if bool(self.backends) == (self.discovery is not None):
            raise ValueError("a model needs either a non-empty `backends` list or `discovery`, not both")
        return self

    @model_validator(mode="after")
    def scaling_needs_a_cap(self) -> Model:
        if self.autoscaling is not None:
            for group, variant in groups_of(self):
                if replica_cap(self, variant) is None:
                    raise ValueError(f"autoscaling of {group} needs the cap of one replica: set"
                                     " autoscaling.replica_cap, discovery.cap or every backend's cap")
        return self

    def compared_provider(self) -> str | None:
        return self.rented_price_from or (self.overflow.provider if self.overflow else None)


class Ledger(Strict):
    """The usage and cost ledger over time, behind `llm-gateway report` (policies/ledger/)."""

    enabled: bool = True
    bucket_seconds: int = Field(60, ge=1, le=3600)  # one row per model, backend and key per bucket
    retention_days: float = Field(35.0, gt=0, le=3660)  # older buckets are deleted
    flush_seconds: float = Field(1.0, ge=0.05, le=60)  # how often the summed figures are written
    power_price_per_kwh: float | None = Field(None, ge=0, le=100)  # needed by any backend with cost.power_kw
    report_window_seconds: float = Field(3600.0, ge=60, le=90 * 86400)  # the window of the Prometheus gauges
    report_every_seconds: float = Field(60.0, ge=1, le=3600)  # how often those gauges are recomputed


EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class Tracing(Strict):
    """OpenTelemetry traces of every call, sent over OTLP/HTTP to the team's own collector (gateway/tracing.py).

    Off by default. Header values (a collector's token) come from environment variables, never from this file,
    and are never logged. A client's `traceparent` is continued and passed to owned backends whether or not this
    is on (to a rented provider only with its `send_trace_context`).
    """

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # the collector's OTLP/HTTP traces URL, path included
    headers_from_env: dict[str, EnvName] = {}  # header name -> the env var holding its value
    sampling_ratio: float = Field(1.0, ge=0, le=1)  # of traces the gateway starts; a client's traceparent decides
    service_name: str = Field("llm-gateway", min_length=1, max_length=128)
    max_queue_size: int = Field(8192, ge=1, le=1_000_000)  # finished calls whose spans wait for export; more
    # are dropped (and counted)
    # calls' spans in one export request (~1 KB each); larger batches spread the export's fixed cost thinner
    max_export_batch_size: int = Field(2048, ge=1, le=100_000)
    schedule_delay: Seconds = 1.0  # seconds between exports of a partial batch
    export_timeout: Seconds = 5.0  # one export to the collector, retries included
    content_models: list[Annotated[str, Field(pattern=NAME)]] = []  # models whose prompt and completion text
    # go into their spans (off for every model unless named here: text may be personal or confidential)

    @field_validator("endpoint")
    @classmethod
    def valid_endpoint(cls, url: str) -> str:
        return http_url(url)

    @model_validator(mode="after")
    def batch_fits_queue(self) -> Tracing:
        if self.max_export_batch_size > self.max_queue_size:
            raise ValueError("max_export_batch_size must not exceed max_queue_size")
        return self

    def headers(self) -> dict[str, str]:
        """The export headers from their environment variables; a missing one is an error naming the variable
        (never the value)."""
        import os

        values = {}
        for header, env in self.headers_from_env.items():
            value = os.environ.get(env)
            if not value:
                raise PolicyError(f"tracing.headers_from_env.{header}: the environment variable {env} is not set")
            values[header] = value
        return values


class AccessLogSettings(Strict):
    format: Literal["text", "json"] = "text"  # json: one JSON object a line, with the trace id, for log pipelines


class Policy(Strict):
    listen: Listen = Listen()
    server: Server = Server()
    timeouts: Timeouts = Timeouts()
    upstream: UpstreamLimits = UpstreamLimits()
    health: Health = Health()
    routing: Routing = Routing()
    store: Store = Store()
    auth: Auth = Auth()
    admin: Admin = Admin()
    rate_limits: RateLimits = RateLimits()
    priorities: Priorities = Priorities()
    caps: Caps = Caps()
    network: Network = Network()
    kubernetes: KubernetesAccess = KubernetesAccess()
    ledger: Ledger = Ledger()
    providers: list[Provider] = []
    tracing: Tracing = Tracing()
    access_log: AccessLogSettings = AccessLogSettings()
    console: Console = Console()
    models: list[Model] = Field(min_length=1)

    @model_validator(mode="after")
    def traced_content_models_exist(self) -> Policy:
        unknown = set(self.tracing.content_models) - {m.name for m in self.models}
        if unknown:
            raise ValueError(f"tracing.content_models names models that are not defined: {', '.join(sorted(unknown))}")
        return self

    @model_validator(mode="after")
    def unique_names(self) -> Policy:
        seen: dict[str, str] = {}
        for model in self.models:
            for public in (model.name, *model.aliases):
                if public in seen:
                    raise ValueError(f"model name or alias {public!r} is used twice ({seen[public]} and {model.name})")
                seen[public] = model.name
        backend_names: set[str] = set()
        for model in self.models:
            for i, backend in enumerate(model.backends):
                name = backend_name(model, i)
                if name in backend_names:
                    raise ValueError(f"backend name {name!r} is used twice")
                backend_names.add(name)
        for model in self.models:
            if model.routing is not None and model.routing not in self.routing.known():
                raise ValueError(f"model {model.name}: routing profile {model.routing!r} is not defined; known: "
                                 f"{', '.join(sorted(self.routing.known()))}")
        providers = {p.name: p for p in self.providers}
        if len(providers) != len(self.providers):
            raise ValueError("provider names must be unique")
        for model in self.models:
            if model.overflow is None:
                continue
            provider = providers.get(model.overflow.provider)
            if provider is None:
                raise ValueError(f"model {model.name}: overflow provider {model.overflow.provider!r} is not declared")
            if model.name not in provider.models:
                raise ValueError(f"model {model.name}: provider {provider.name} has no mapping for it")
        for i, model in enumerate(self.models):
            if model.rented_price_from is not None and model.rented_price_from not in providers:
                raise ValueError(f"models[{i}](name={model.name}).rented_price_from: provider "
                                 f"{model.rented_price_from!r} is not declared")
            for j, backend in enumerate(model.backends):
                if backend.cost and backend.cost.power_kw and self.ledger.power_price_per_kwh is None:
                    raise ValueError(f"models[{i}](name={model.name}).backends[{j}].cost.power_kw: needs "
                                     "ledger.power_price_per_kwh to price the power")
        return self


def profile_of(policy: Policy, model: Model) -> tuple[str, RoutingProfile]:
    name = model.routing or policy.routing.default_profile
    return name, policy.routing.profile(name)


def groups_of(model: Model) -> list[tuple[str, Variant | None]]:
    """A model's replica sets (backends/replicas.py group_name): one per variant, or the model's own."""
    return [(group_name(model.name, v.name), v) for v in model.variants] or [(model.name, None)]


def replica_cap(model: Model, variant: Variant | None) -> int | None:
    """The cap of one replica of a model's replica set (its variant's, if given), for the scaling signal:
    autoscaling.replica_cap, else discovery.cap, else the mean of its backends' caps (None if one has none)."""
    if model.autoscaling is not None and model.autoscaling.replica_cap is not None:
        return model.autoscaling.replica_cap
    owner = variant or model
    if owner.discovery is not None:
        return owner.discovery.cap
    caps = [b.cap for b in owner.backends]
    if not caps or None in caps:
        return None
    return max(1, round(sum(caps) / len(caps)))


def backend_name(model: Model, index: int) -> str:
    return model.backends[index].name or f"{model.name}-{index}"


class PolicyError(Exception):
    """A policy file that cannot be used; the message names every bad field and why."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in keys:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the policy file must be a mapping with at least `models:`")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"{source}: invalid policy\n" + format_errors(exc, data)) from None


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_policy(text, str(path))


def format_errors(exc: ValidationError, data: Any) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        where = _location(err["loc"], data)
        if err["type"] == "extra_forbidden":
            message = "unknown field (not part of the policy schema)"
        elif err["type"] == "missing":
            message = "required field is missing"
        else:
            message = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err['input']!r:.80})"
        lines.append(f"  {where}: {message}{got}")
    return "\n".join(lines)


def _location(loc: tuple[Any, ...], data: Any) -> str:
    """models.0.backends.1.url -> models[0](name=chat).backends[1].url, so the reader finds it in the file."""
    out = ""
    node = data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                out += f"(name={node['name']})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "<root>"

