"""Pipeline step: resolve the `model` a client asked for (a public name or an alias) to a served model.

A LoRA adapter (policies/config/lora.py) is a model of its own here: the call is named after the adapter
(keys, limits, budgets, ledger, metrics and traces see it), admitted to its base model's replicas and queue
(`call.group`), and carries what vLLM knows the adapter by (`call.adapter`). With `lora.discover` the
adapters the replicas list in their /v1/models are models too, found by name as they are asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from backends.lora import AdapterTarget
from policies.config import Policy
from policies.errors import BadRequest, NotFound
from policies.pipeline import MODEL, Call


class ResolveModel:
    name = "resolve-model"
    writes = (MODEL,)

    def __init__(self, policy: Policy, found: Callable[[str], Mapping[str, AdapterTarget]] | None = None) -> None:
        self.public: dict[str, str] = {}
        # models whose replicas' own adapters are models too (lora.discover), and where to read them
        self.discovering = [m.name for m in policy.models if m.lora is not None and m.lora.discover and found]
        self.found = found
        self.adapters: dict[str, tuple[str, AdapterTarget]] = {}  # adapter's name -> (base model, target)
        for model in policy.models:
            for name in (model.name, *model.aliases):
                self.public[name] = model.name
            for adapter in model.lora.adapters if model.lora is not None else ():
                for name in (adapter.name, *adapter.aliases):
                    self.public[name] = adapter.name
                self.adapters[adapter.name] = (model.name, AdapterTarget(adapter.lora_name, adapter.path))

    async def enter(self, call: Call) -> None:
        requested = call.asked_model
        if not isinstance(requested, str) or not requested:
            raise BadRequest("you must provide a model parameter", param="model", code="missing_model")
        model = self.public.get(requested)
        if model is None and self.discovering:
            model = self.discovered(call, requested)
        if model is None:
            raise NotFound(
                f"The model `{requested[:200]}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        MODEL.put(call, model)
        adapter = self.adapters.get(model)
        if adapter is not None:
            call.group, call.adapter = adapter

    def discovered(self, call: Call, requested: str) -> str | None:
        """An adapter a replica of a discovering model holds, not named in the policy: the call is its."""
        if self.found is None:
            return None
        for base in self.discovering:
            target = self.found(base).get(requested)
            if target is not None:
                call.group, call.adapter = base, target
                return requested
        return None

    async def leave(self, call: Call) -> None:
        pass
