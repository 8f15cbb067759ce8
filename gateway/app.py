"""The app factory: one `Gateway` holds a process's state; `create_app` wires it to HTTP.

/v1/* is served by the lean OpenAI routes; health, readiness, metrics and the admin API by Litestar, which also
owns the lifespan that opens the shared upstream client and runs the health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Literal

import orjson
from litestar import Litestar, MediaType, Request, Response, get
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
)
from litestar.openapi import ResponseSpec
from litestar.plugins.pydantic import PydanticInitPlugin
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from backends.egress import Resolver, SystemResolver
from backends.replicas import DOWN, Replica
from backends.upstream import new_client
from backends.vllm_stats import Scraper
from gateway.admin_auth import AdminAuth
from gateway.admin_routes import admin_router
from gateway.background import Background
from gateway.openai_routes import OpenAIRoutes
from gateway.openapi import StrictModels, openapi_config
from gateway.proxy import Proxy
from gateway.tracing import tracing_for
from policies.accounting import RecordUsage
from policies.admission import Admission
from policies.auth import Authenticate, Authorize
from policies.compile import rented_providers, replica_set, routing_profiles
from policies.config import Policy
from policies.egress import check_backends, exempt_origins
from policies.errors import (
    BadRequest,
    GatewayError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    StateUnavailable,
)
from policies.keys import KeyRecord
from policies.metrics import GatewayMetrics
from policies.models import ResolveModel
from policies.network import ClientNetwork
from policies.pipeline import Pipeline
from policies.ratelimit import MemoryLimiter
from policies.ratelimit.step import RateLimit
from policies.routing import Stats
from policies.store import StoreUnavailable, open_store

log = logging.getLogger("gateway")


class Gateway:
    """Everything one gateway process holds for its lifetime."""

    def __init__(self, policy: Policy, resolver: Resolver | None = None) -> None:
        self.policy = policy
        self.resolver = resolver or SystemResolver()  # tests inject one whose answers they control
        self.metrics = GatewayMetrics()
        self.replicas = replica_set(policy, on_change=self._replica_changed)
        for replica in self.replicas:
            self._replica_changed(replica)
        scrape = policy.routing.scrape
        self.scraper = Scraper(lambda: list(self.replicas), scrape.interval, scrape.timeout, scrape.stale_after,
                               on_scrape=self._scraped)
        self.profiles = routing_profiles(policy, Stats(self.scraper.stats if scrape.enabled else None),
                                         self.metrics)
        self.admission = Admission(policy, self.replicas, self.profiles, self.metrics)
        self.rented = rented_providers(policy)
        store = policy.store
        options = {"prefix": store.prefix, "password": store.password()} if store.kind == "redis" else {}
        self.store = open_store(store.kind, path=store.path, url=store.url, **options)
        self.background = Background(lambda why: self.metrics.background_errors.labels(why).inc())
        self.admin_auth = AdminAuth(policy.admin)
        self.authenticate = Authenticate(self.store, policy.auth.cache_seconds, self.background.run)
        self.limiter = open_limiter(self.store)
        self.client_network = ClientNetwork(policy.network)
        self.record_usage = RecordUsage(self.store, self.background.run)
        self.pipeline = Pipeline([
            self.client_network,
            self.authenticate,
            ResolveModel(policy),
            Authorize(),
            RateLimit(policy, self.limiter, self.background.run, self.metrics),
            self.record_usage,
        ])
        self.proxy: Proxy | None = None
        self.tracing = tracing_for(policy.tracing, self.metrics)  # raises PolicyError for an unset header variable
        self.draining = False  # set by SIGTERM (gateway/server.py): /ready answers 503 from then on
        self._created = int(time.time())

    def models_listing(self, key: KeyRecord) -> bytes:
        """/v1/models: only the models this key may use."""
        allowed = key.models
        return orjson.dumps({
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": self._created, "owned_by": "llm-gateway"}
                for m in self.policy.models
                if allowed is None or m.name in allowed
            ],
        })

    def start_drain(self) -> None:
        """The process is going away: readiness fails at once so the Service stops routing here (a flag only,
        as it is called from a signal handler)."""
        self.draining = True

    def forget_key(self, key_id: str) -> None:
        """Drop a changed key from this process's cache at once (other replicas follow within the bound)."""
        self.authenticate.cache.drop(key_id)

    def _replica_changed(self, replica: Replica) -> None:
        self.metrics.backend_up.labels(replica.model, replica.name).set(0 if replica.state == DOWN else 1)
        admission = getattr(self, "admission", None)  # absent while the replica set is being built
        if admission is not None:
            admission.replica_changed(replica)

    def _scraped(self, replica: Replica, stats, error: str | None) -> None:
        self.metrics.scraped(replica.model, replica.name, self.scraper.age(replica), failed=error is not None)

    def _egress_refused(self, host: str, _port: int, _address: str) -> None:
        self.metrics.egress_refused.labels(host).inc()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Litestar) -> AsyncIterator[None]:
        t = self.policy.timeouts
        # A policy violation found now stops startup; a name that does not resolve yet only logs (see README).
        await check_backends(self.policy, self.resolver, unresolved_fatal=False)
        client = new_client(
            t.connect, t.read, t.write, private_cidrs=self.policy.network.private_cidrs, resolver=self.resolver,
            exempt=exempt_origins(self.policy), on_refused=self._egress_refused,
        )
        overflow = {m.name: m.overflow for m in self.policy.models if m.overflow}
        self.proxy = Proxy(self.replicas, self.admission, self.pipeline, self.metrics, client, self.rented, overflow)
        self.proxy.tracing = self.tracing
        self.proxy.access_log.json = self.policy.access_log.format == "json"
        loops = [asyncio.create_task(self.replicas.run_checks(client, t.health_check))]
        if self.policy.routing.scrape.enabled:
            loops.append(asyncio.create_task(self.scraper.run(client)))
        try:
            yield
        finally:
            for loop in loops:
                loop.cancel()
            for loop in loops:
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
            self.proxy.access_log.flush()
            self.background.run(self.record_usage.flush())
            await self.background.drain(timeout=5)
            await client.aclose()
            await asyncio.to_thread(self.tracing.close)  # exports what is queued, bounded by its export timeout
            await self.store.close()


def open_limiter(store):
    """Limits live beside the keys: in Redis when keys are shared, in this process with the embedded store."""
    from policies.store.redis import RedisStore

    if isinstance(store, RedisStore):
        from policies.ratelimit.redis import RedisLimiter

        return RedisLimiter(store)
    return MemoryLimiter()


def openai_error(exc: GatewayError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type=MediaType.JSON, headers=exc.headers)


def on_http_exception(_request: Request, exc: HTTPException) -> Response:
    if isinstance(exc, NotFoundException):
        return openai_error(NotFound("unknown path", code="unknown_url"))
    if isinstance(exc, MethodNotAllowedException):  # keeps Litestar's Allow header, which RFC 9110 requires
        return openai_error(MethodNotAllowed("method not allowed on this path", headers=exc.headers))
    if isinstance(exc, GatewayError):
        return openai_error(exc)
    detail = str(exc.detail)
    if isinstance(exc.extra, list):  # validation failures: say which field and why
        problems = [problem(e) for e in exc.extra if isinstance(e, dict)]
        detail = f"{detail}: {'; '.join(problems)}" if problems else detail
    error = GatewayError(detail)
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return openai_error(error)


def problem(error: dict) -> str:
    if error.get("key") == "data" and error.get("message") == "'data'":  # Litestar's KeyError for an absent body
        return "the request body is missing: send a JSON object"
    return f"{error.get('key')}: {error.get('message')}"


def on_gateway_error(_request: Request, exc: GatewayError) -> Response:
    return openai_error(exc)


def on_store_down(_request: Request, _exc: StoreUnavailable) -> Response:
    return openai_error(StateUnavailable("the key store is unavailable; try again shortly"))


def on_invalid(_request: Request, exc: ValidationError) -> Response:
    """A record that fails validation after merging an admin's changes: a 400 naming the field."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    return openai_error(BadRequest(f"{where}: {first['msg']}", param=where or None))


def on_unexpected(_request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in the ops/admin app", exc_info=exc)
    return openai_error(InternalError("the gateway failed to handle the request"))


class Liveness(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["ok"]


class Readiness(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["ready", "not_ready", "draining"]
    models: dict[str, bool]


def create_app(policy: Policy, resolver: Resolver | None = None):
    gateway = Gateway(policy, resolver)

    @get("/health", sync_to_thread=False)
    def health() -> Liveness:
        """Liveness: the process is serving."""
        return Liveness(status="ok")

    @get("/ready", sync_to_thread=False, responses={
        503: ResponseSpec(Readiness, description="Some model has no backend that passed its health check, or the"
                          " process is draining for shutdown (it still serves what reaches it)",
                          generate_examples=False),
    })
    def ready() -> Response[Readiness]:
        """Readiness: every model has at least one backend that answered its health check, and the process is
        not draining for shutdown (then 503 while it still serves what reaches it)."""
        models = gateway.replicas.ready()
        if gateway.draining:  # shutting down: still serving, but take this replica out of the Service
            return Response(Readiness(status="draining", models=models), status_code=503, media_type=MediaType.JSON)
        ok = all(models.values())
        body = Readiness(status="ready" if ok else "not_ready", models=models)
        return Response(body, status_code=200 if ok else 503, media_type=MediaType.JSON)

    @get("/metrics", media_type=MediaType.TEXT, sync_to_thread=False)
    def metrics() -> Response[str]:
        """Prometheus metrics in the text exposition format."""
        # The header is set whole: given a media type, Litestar would append a second charset to this one.
        return Response(generate_latest(gateway.metrics.registry), headers={"content-type": CONTENT_TYPE_LATEST})

    ops = Litestar(
        route_handlers=[health, ready, metrics, admin_router(gateway)],
        openapi_config=openapi_config(),
        # Bodies are validated strictly: `true` is not 1 and "5" is not 5, as the schema says.
        plugins=[PydanticInitPlugin(validate_strict=True), StrictModels()],
        lifespan=[gateway.lifespan],
        exception_handlers={
            GatewayError: on_gateway_error,
            StoreUnavailable: on_store_down,
            ValidationError: on_invalid,
            HTTPException: on_http_exception,
            Exception: on_unexpected,
        },
        request_max_body_size=policy.server.max_body_bytes,
        logging_config=None,  # logging is the process's business (gateway/cli.py), not the framework's
    )
    app = OpenAIRoutes(gateway, ops)
    app.state = gateway  # handy for tests and the CLI
    return app
