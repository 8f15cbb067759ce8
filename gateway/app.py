"""The app factory: `create_app` makes a process's `Gateway` (gateway/wiring.py) and wires it to HTTP.

/v1/* is served by the lean OpenAI routes; health, readiness, metrics, the replica counts for an autoscaler, the
admin API and the console by Litestar, which also runs the gateway's lifespan (the shared upstream client, the
health checks, the background loops). The errors of the ops/admin app are answered in OpenAI's shape here.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol, cast

from litestar import Litestar, MediaType, Response, get
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
)
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import ResponseSpec
from litestar.params import Parameter
from litestar.plugins.pydantic import PydanticInitPlugin
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from backends.egress import Resolver
from backends.replicas import ReplicaSet
from gateway.admin.routes import admin_router
from gateway.http.asgi import AnyRequest, App
from gateway.console import console_routes, security_headers
from gateway.console import templates as console_templates
from gateway.openai_routes import OpenAIRoutes
from gateway.openapi import StrictModels, errors, openapi_config
from gateway.admin.variants import slashed_model_names
from gateway.wiring import Gateway
from policies.config import Policy
from policies.errors import (
    BadRequest,
    GatewayError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    StateUnavailable,
)
from policies.metrics import GatewayMetrics
from policies.scaling import ScalingSignal
from policies.store import StoreUnavailable

log = logging.getLogger("gateway")

VALIDATION_FAILED = "Validation failed for "  # how Litestar begins a parameter's or a body's refusal


def openai_error(exc: GatewayError) -> Response[bytes]:
    return Response(exc.body(), status_code=exc.status, media_type=MediaType.JSON, headers=exc.headers)


def on_http_exception(request: AnyRequest, exc: HTTPException) -> Response[bytes]:
    if isinstance(exc, NotFoundException):
        return openai_error(NotFound("unknown path", code="unknown_url"))
    if isinstance(exc, MethodNotAllowedException):  # keeps Litestar's Allow header, which RFC 9110 requires
        return openai_error(MethodNotAllowed("method not allowed on this path", headers=exc.headers))
    if isinstance(exc, GatewayError):
        return openai_error(exc)
    detail = str(exc.detail)
    if detail.startswith(VALIDATION_FAILED):  # Litestar quotes the whole URL: never echo a query's values
        detail = f"{VALIDATION_FAILED}{request.method} {request.url.path}"
    if isinstance(exc.extra, list):  # validation failures: say which field and why
        problems = [problem(e) for e in exc.extra if isinstance(e, dict)]
        detail = f"{detail}: {'; '.join(problems)}" if problems else detail
    error = GatewayError(detail)
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return openai_error(error)


def problem(error: dict[str, Any]) -> str:
    if error.get("key") == "data" and error.get("message") == "'data'":  # Litestar's KeyError for an absent body
        return "the request body is missing: send a JSON object"
    return f"{error.get('key')}: {error.get('message')}"


def on_gateway_error(_request: AnyRequest, exc: GatewayError) -> Response[bytes]:
    return openai_error(exc)


def on_store_down(_request: AnyRequest, _exc: StoreUnavailable) -> Response[bytes]:
    return openai_error(StateUnavailable("the key store is unavailable; try again shortly"))


def on_invalid(_request: AnyRequest, exc: ValidationError) -> Response[bytes]:
    """A record that fails validation after merging an admin's changes: a 400 naming the field."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    return openai_error(BadRequest(f"{where}: {first['msg']}", param=where or None))


def on_unexpected(_request: AnyRequest, exc: Exception) -> Response[bytes]:
    log.exception("unhandled error in the ops/admin app", exc_info=exc)
    return openai_error(InternalError("the gateway failed to handle the request"))


class Liveness(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["ok"]


class Readiness(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["ready", "degraded", "starting", "draining"]
    models: dict[str, bool]


class Probed(Protocol):
    """What /ready, /metrics and /scaling read: the replicas' health, the drain, the metrics and the scaling signal."""

    replicas: ReplicaSet
    draining: bool
    metrics: GatewayMetrics
    scaling: ScalingSignal


def ops_handlers(gateway: Probed) -> list[HTTPRouteHandler]:
    """/health, /ready, /metrics and /scaling: for the orchestrator, Prometheus and an autoscaler, without a token."""

    @get("/health", sync_to_thread=False)
    def health() -> Liveness:
        """Liveness: the process is serving."""
        return Liveness(status="ok")

    @get("/ready", sync_to_thread=False, responses={
        503: ResponseSpec(Readiness, description="The process is starting (its first round of health checks has"
                          " not ended) or draining for shutdown (it still serves what reaches it)",
                          generate_examples=False),
    })
    def ready() -> Response[Readiness]:
        """Readiness of this gateway process, one rule for static and discovered models: 200 once the first
        round of health checks has ended and until SIGTERM starts the drain; 503 before and after. A model
        without a healthy backend does not take the pod out (every gateway pod sees the same backends, and the
        healthy models must stay reachable): the body says which models can serve now, and `status` is
        `degraded` while some cannot."""
        models = gateway.replicas.ready()
        if gateway.draining:  # shutting down: still serving, but take this replica out of the Service
            return Response(Readiness(status="draining", models=models), status_code=503, media_type=MediaType.JSON,
                            headers={"retry-after": "1"})
        if not gateway.replicas.probed_once:
            return Response(Readiness(status="starting", models=models), status_code=503, media_type=MediaType.JSON,
                            headers={"retry-after": "1"})
        body = Readiness(status="ready" if all(models.values()) else "degraded", models=models)
        return Response(body, status_code=200, media_type=MediaType.JSON)

    @get("/metrics", media_type=MediaType.TEXT, sync_to_thread=False)
    def metrics() -> Response[bytes]:
        """Prometheus metrics in the text exposition format."""
        # The header is set whole: given a media type, Litestar would append a second charset to this one.
        return Response(generate_latest(gateway.metrics.registry), headers={"content-type": CONTENT_TYPE_LATEST})

    @get("/scaling", sync_to_thread=False, responses=errors(400, 404))
    def scaling(model: str | None = Parameter(default=None, max_length=3 * 128, description="one model (or"
                                              " `model#variant`): its figures alone")) -> dict[str, Any]:
        """The replicas each model needs at its knee (policies/scaling.py), for an autoscaler: KEDA's metrics-api
        scaler reads `needed` from `/scaling?model=NAME`. Served as /metrics is, without a token (the chart's
        NetworkPolicy decides who reaches it); it holds counts only, never a key or a prompt."""
        view = gateway.scaling.view(model)
        if view is None:  # only for a model named: without one, the view is every model's
            raise NotFound(f"model {str(model)[:128]!r} has no scaling signal (unknown, or its replica cap is not"
                           " known)", param="model", code="model_not_found")
        return view

    return [health, ready, metrics, scaling]


class GatewayApp(OpenAIRoutes):
    """The process's ASGI app: the OpenAI routes in front of the ops/admin app, and `state`, the process's
    `Gateway` (handy for tests and the CLI)."""

    def __init__(self, gateway: Gateway, ops: Litestar) -> None:
        super().__init__(gateway, slashed_model_names(cast("App", ops)))  # Litestar's ASGI types are its own
        self.state = gateway


def create_app(policy: Policy, resolver: Resolver | None = None, policy_path: str | None = None,
               version: str | None = None) -> GatewayApp:
    """`policy_path`: the file the policy came from, watched for changes (and reread on SIGHUP)."""
    gateway = Gateway(policy, resolver, policy_path, version)
    ops = Litestar(
        route_handlers=[*ops_handlers(gateway), admin_router(gateway), *console_routes(gateway)],
        template_config=console_templates(),
        before_send=[security_headers],
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
        logging_config=None,  # logging is the process's business (gateway/cli/__init__.py), not the framework's
    )
    return GatewayApp(gateway, ops)
