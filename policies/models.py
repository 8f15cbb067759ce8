"""Pipeline step: resolve the `model` a client asked for (a public name or an alias) to a served model."""

from __future__ import annotations

from policies.config import Policy
from policies.errors import BadRequest, NotFound
from policies.pipeline import Call


class ResolveModel:
    name = "resolve-model"

    def __init__(self, policy: Policy) -> None:
        self.public: dict[str, str] = {}
        for model in policy.models:
            for name in (model.name, *model.aliases):
                self.public[name] = model.name

    async def enter(self, call: Call) -> None:
        requested = call.asked_model
        if not isinstance(requested, str) or not requested:
            raise BadRequest("you must provide a model parameter", param="model", code="missing_model")
        model = self.public.get(requested)
        if model is None:
            raise NotFound(
                f"The model `{requested[:200]}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        call.model = model

    async def leave(self, call: Call) -> None:
        pass
