"""GET and PUT /admin/models/{model}/variants: a model's variants and their weights, changed live; and
GET /admin/variants: every model's variants side by side, with what their recent answers say
(policies/variant_signals.py) and their guard's verdict.

Reading needs a viewer token; changing the weights an operator (or admin) token. A change is in force for the
next request at once, without a reload or a restart; requests already assigned finish on their variant. The
policy file's weights come back only when the file's weights for that model change (policies/variants.py).

A model's name may hold "/" (`Qwen/Qwen3-4B`, vLLM's usual served name) where a path segment cannot:
`slashed_model_names` lets /admin/models/Qwen/Qwen3-4B/variants and /admin/models/Qwen%2FQwen3-4B/variants
(the server decodes %2F before routing, so the two arrive alike) both reach the route.
"""

from __future__ import annotations

from typing import Any, Protocol

from litestar import get, put
from litestar.handlers import HTTPRouteHandler
from litestar.params import JSONBody, Parameter
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin.audit import Audited
from gateway.http.asgi import AnyConnection, AnyRequest, App, Receive, Scope, Send, text_of
from gateway.openapi import errors
from policies.audit import diff
from policies.errors import Conflict, NotFound
from policies.snapshot import Shared
from policies.variants import NoLiveWeight, UnknownVariant, Variants


class VariantView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    weight: float = Field(description="the weight now in force")
    shadow: bool
    filed_weight: float = Field(description="the weight the policy file gives it")
    guard: dict[str, Any] | None = Field(None, description="the guard's state, the reason of its last action, and while it"
                               " cannot judge yet why (`undecided`) and since when (`undecided_for_s`, `warning`), and each latency"
                               " signal's worst candidate/baseline ratio at its last look (`ratios`)")


class ModelVariants(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    sticky: dict[str, Any] | None = Field(description="what keeps a conversation on one variant (header, key)")
    variants: list[VariantView]


class NewWeight(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64, description="a variant of the model")
    weight: float = Field(ge=0, le=1_000_000)


class LoadFigures(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: int
    ttft_p50: float | None
    itl_p50: float | None


class VariantSignals(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    weight: float
    shadow: bool
    requests: int = Field(description="calls in the window")
    errors: dict[str, int] = Field(description="failed calls by kind")
    error_rate: float | None = Field(description="share of calls failed by the variant's fault (upstream_error,"
                                     " timeout, no_backend)")
    ttft_p50: float | None = Field(description="seconds from sending to the first token (queue excluded)")
    itl_p50: float | None = Field(description="seconds between output tokens of a stream")
    tokens_per_second_p50: float | None = Field(description="output tokens per second of a stream")
    structured: int = Field(description="answers with structured output (response_format JSON, tool calls)")
    structured_valid_rate: float | None
    length_rate: float | None = Field(description="share of answers with finish_reason length")
    shadow_compared: int = Field(description="shadow answers compared with the live one")
    agreement_rate: float | None = Field(description="shadow answers equal to the live one, exactly or as JSON")
    exact_match_rate: float | None = Field(description="shadow answers equal to the live one byte for byte")
    by_load: dict[str, LoadFigures] = Field(description="medians per load level: requests in flight to the"
                                             " replica when sent, up to this many")
    guard: dict[str, Any] | None = Field(None, description="the guard's state and the reason of its last action")


class ModelSignals(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variants: list[VariantSignals]


class AllVariants(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: dict[str, ModelSignals]


class WeightChange(BaseModel):
    """A list rather than a mapping: the OpenAPI document then keeps the bounds of every weight."""

    model_config = ConfigDict(extra="forbid")
    weights: list[NewWeight] = Field(description="the variants whose weight changes; the others keep theirs")


ModelName = Parameter(max_length=3 * 128, description="the model's public name (a \"/\" in it as %2F)")
PREFIX, SUFFIX = "/admin/models/", "/variants"
SLASH = "%2F"  # never in a name: the policy's names leave "%" out


def slashed_model_names(app: App) -> App:
    """An ASGI wrapper: a request for /admin/models/<name>/variants whose name holds "/" is routed with each "/"
    as %2F, so the name stays one path segment; the route's handlers turn them back (`model_of`)."""

    async def routed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = text_of(scope, "path")
            if path.startswith(PREFIX) and path.endswith(SUFFIX) and "/" in path[len(PREFIX):-len(SUFFIX)]:
                scope = {**scope, "path": PREFIX + path[len(PREFIX):-len(SUFFIX)].replace("/", SLASH) + SUFFIX}
        await app(scope, receive, send)

    return routed


def model_of(segment: str) -> str:
    return segment.replace(SLASH, "/")


class Weighing(Audited, Protocol):
    """Every model's variant weights (held with what every snapshot shares), and the audit log of their changes."""

    shared: Shared


def variant_handlers(gateway: Weighing) -> list[HTTPRouteHandler]:
    variants = gateway.shared.variants

    def current(model: str) -> ModelVariants:
        return current_variants(variants, model)

    @get("/models/{model:str}/variants", summary="A model's variants and the weights in force",
         sync_to_thread=False, responses=errors(400, 401, 404))
    def show(model: str = ModelName) -> ModelVariants:
        return current(model_of(model))

    @put("/models/{model:str}/variants", summary="Change variant weights live (operator role)",
         opt={"operator": True}, responses=errors(400, 401, 403, 404, 409, 413))
    async def change(request: AnyRequest, data: JSONBody[WeightChange], model: str = ModelName) -> ModelVariants:
        return await change_weights(gateway, request, model_of(model), {w.name: w.weight for w in data.weights},
                                    "admin API")

    @get("/variants", summary="Every model's variants side by side: speed, errors, structured validity",
         sync_to_thread=False, responses=errors(400, 401))
    def signals(window: int | None = Parameter(default=None, ge=1, le=86400 * 30, description="only calls this"
                                               " many seconds recent (default: the whole kept window)")) -> AllVariants:
        return AllVariants.model_validate({"models": variants.report(window)})

    return [show, change, signals]


def current_variants(variants: Variants, model: str) -> ModelVariants:
    view = variants.view(model)
    if view is None:
        raise NotFound(f"model {model[:200]} has no variants", code="model_not_found")
    return ModelVariants.model_validate(view)


async def change_weights(gateway: Weighing, connection: AnyConnection, model: str, weights: dict[str, float],
                         why: str) -> ModelVariants:
    """Set some of a model's variant weights live (the admin API's PUT and the console's form), and record the
    act in the audit log as the admin whose claims the connection's guard left in its scope."""
    variants = gateway.shared.variants
    before = weights_of(current_variants(variants, model))
    try:
        if weights:
            variants.set_weights(model, weights, why=why)
    except UnknownVariant as exc:
        raise NotFound(str(exc), param="weights", code="variant_not_found") from None
    except NoLiveWeight as exc:
        raise Conflict(str(exc), param="weights", code="no_live_weight") from None
    after = current_variants(variants, model)
    await gateway.audit.act(connection, "variants.weights", model, diff(before, weights_of(after)))
    return after


def weights_of(view: ModelVariants) -> dict[str, float]:
    return {v.name: v.weight for v in view.variants}
