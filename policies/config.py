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


class Health(Strict):
    interval: Seconds = 5.0
    failure_threshold: int = Field(1, ge=1, le=100)
    backoff_initial: Seconds = 1.0
    backoff_max: Seconds = 60.0


class Server(Strict):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1024**3)
    # SIGTERM (a rolling update) first drains: /ready answers 503 while every route keeps serving this long,
    # so the Service stops routing here before the listener closes. 0: close at once (a process nobody
    # reaches through a Service); the Helm chart sets it with shutdown_timeout from one value.
    drain_seconds: float = Field(0.0, ge=0, le=3600)
    # after the drain: how long requests in flight (streams) may take to finish before they are cut
    shutdown_timeout: Seconds = 30.0


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


class Store(Strict):
    kind: Literal["sqlite", "redis"] = "sqlite"
    path: str = "llm-gateway.db"  # sqlite: the database file
    url: str = "redis://127.0.0.1:6379/0"  # redis
    prefix: str = Field("llmgw:", min_length=1, max_length=64)  # redis: namespace of every key
    # redis: the env var holding the server's password, so the file (a ConfigMap) never carries it
    password_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @model_validator(mode="after")
    def one_password(self) -> Store:
        if self.password_env and urlsplit(self.url).password is not None:
            raise ValueError("url carries a password and password_env names one too: keep it in the env var only")
        return self

    def password(self) -> str | None:
        """The Redis password from `password_env` (None when unset); an empty or missing variable is an error
        that names the variable, never a silent attempt without the password."""
        if not self.password_env:
            return None
        import os

        value = os.environ.get(self.password_env)
        if not value:
            raise PolicyError(f"store.password_env: the environment variable {self.password_env} is not set")
        return value


class Auth(Strict):
    cache_seconds: float = Field(5.0, ge=0, le=300)  # verified keys are cached this long; revocation bound


class Admin(Strict):
    jwt_algorithm: Literal["HS256", "RS256", "ES256"] = "HS256"
    jwt_secret_env: str = "LLM_GATEWAY_ADMIN_SECRET"  # HS256: the env var holding the shared secret
    jwt_public_key_file: str | None = None  # RS256/ES256: PEM public key that verifies tokens
    issuer: str = "llm-gateway"
    audience: str = "llm-gateway-admin"
    leeway_seconds: float = Field(5.0, ge=0, le=300)

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


class Backend(Strict):
    url: str
    name: str | None = Field(None, pattern=NAME)
    served_name: str | None = Field(None, pattern=NAME)
    cap: int | None = Field(None, ge=1, le=100_000)  # most requests in flight to it: its measured knee
    # the path probed for health: vLLM serves /health; KServe's Hugging Face runtime only /v1/models/<name>
    health_path: str = Field("/health", pattern=r"^/[A-Za-z0-9._~:@!$&'()*+,;=/%-]*$", max_length=256)
    adaptive: Adaptive | None = None  # optional: track the live knee below `cap` from observed TTFT

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


class Model(Strict):
    name: str = Field(pattern=NAME)
    aliases: list[Annotated[str, Field(pattern=NAME)]] = []
    served_name: str | None = Field(None, pattern=NAME)
    limits: LimitValues | None = None  # the model's totals across every key
    queue: Queue = Queue()
    overflow: Overflow | None = None  # None: this model never leaves the cluster
    routing: str | None = Field(None, pattern=NAME)  # a routing profile's name (default: routing.default_profile)
    backends: list[Backend] = Field(min_length=1)


EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class Tracing(Strict):
    """OpenTelemetry traces of every call, sent over OTLP/HTTP to the team's own collector (gateway/tracing.py).

    Off by default. Header values (a collector's token) come from environment variables, never from this file,
    and are never logged. A client's `traceparent` is continued and passed upstream whether or not this is on.
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
    health: Health = Health()
    routing: Routing = Routing()
    store: Store = Store()
    auth: Auth = Auth()
    admin: Admin = Admin()
    rate_limits: RateLimits = RateLimits()
    network: Network = Network()
    providers: list[Provider] = []
    tracing: Tracing = Tracing()
    access_log: AccessLogSettings = AccessLogSettings()
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
        return self


def profile_of(policy: Policy, model: Model) -> tuple[str, RoutingProfile]:
    name = model.routing or policy.routing.default_profile
    return name, policy.routing.profile(name)


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

