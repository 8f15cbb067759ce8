"""Model variants: weights in force, what their recent answers say, the guard's state and its reasons; an
operator changes the weights here (gateway/admin/variants.py change_weights, as PUT /admin/models/{model}/variants)."""

from __future__ import annotations

from typing import Any

from litestar import get, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import Template

from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import page
from gateway.console.session import form_of
from gateway.admin.variants import (
    AllVariants,
    Weighing,
    WeightChange,
    change_weights,
    current_variants,
)
from policies.errors import BadRequest

WINDOW = 3600  # seconds of answers the side-by-side figures cover
WEIGHT = "weight:"  # form fields: weight:<variant name>


def handlers(gateway: Weighing) -> list[HTTPRouteHandler]:
    variants = gateway.shared.variants

    def model_context(model: str) -> dict[str, Any]:
        signals = AllVariants.model_validate({"models": variants.report(WINDOW)}).models.get(model)
        return {"model": model, "view": current_variants(variants, model), "signals": signals}

    @get("/variants")
    async def show(request: AnyRequest) -> Template:
        models = [model_context(m) for m in variants.report(WINDOW)]
        return page(request, "variants.html", "Variants", models=models, window=WINDOW)

    @post("/variants", opt={"role": "operator"}, status_code=200)
    async def change(request: AnyRequest) -> Template:
        fields = await form_of(request)
        model = fields.get("model", "")
        sent = []
        for name, value in fields.items():
            if name.startswith(WEIGHT):
                try:
                    sent.append({"name": name[len(WEIGHT):], "weight": float(value)})
                except ValueError:
                    raise BadRequest(f"the weight of {name[len(WEIGHT):][:64]} is not a number",
                                     param=name[:80]) from None
        weights = WeightChange.model_validate({"weights": sent}).weights  # the admin API's bounds
        await change_weights(gateway, request, model, {w.name: w.weight for w in weights},
                             f"console ({request.state.viewer.subject})")
        return page(request, "variant_model.html", "Variants", m=model_context(model), message="Saved.")

    return [show, change]


PAGE = Page("variants", "Variants", handlers)
