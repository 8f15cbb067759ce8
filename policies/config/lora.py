"""The policy file's LoRA settings of a base model: its adapters, each served as a model of its own.

An adapter shares its base model's replicas, caps and queue; vLLM on those replicas must run with
`--enable-lora` (and, to load adapters on demand, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). See README "LoRA
adapters".
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdapterLimits(_Strict):
    """The adapter's totals across every key (as a model's `limits`)."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)


class Adapter(_Strict):
    name: str = Field(pattern=NAME)  # the public model name clients send
    aliases: list[Annotated[str, Field(pattern=NAME)]] = []
    # where vLLM loads it from (a directory on the replica: a volume, or what an init step fetched); null: it
    # is only routed to replicas that already serve it (started with --lora-modules), never loaded
    path: str | None = Field(None, min_length=1, max_length=1024)
    served_name: str | None = Field(None, pattern=NAME)  # vLLM's lora_name for it (default: name)
    limits: AdapterLimits | None = None

    @property
    def lora_name(self) -> str:
        return self.served_name or self.name


class Lora(_Strict):
    adapters: list[Adapter] = []
    # adapters one replica holds at most (vLLM's --max-loras): loading one more first unloads the least
    # recently used one that no request of this gateway is using
    max_loras: int = Field(1, ge=1, le=1024)
    # how long a request waits for its adapter to be loaded on the chosen replica (a load reads the adapter's
    # files; on a GPU it takes well under a second for small ranks): past it, 504 naming the adapter
    load_timeout: float = Field(30.0, gt=0, le=600)
    # how often each replica's /v1/models is read for the adapters it really holds (a restarted vLLM holds
    # none; one loaded by someone else counts); an adapter call that vLLM answers 404 is reloaded at once anyway
    refresh_seconds: float = Field(5.0, ge=0.1, le=3600)
    # also serve, as models, the adapters the replicas list in their /v1/models that `adapters` does not name
    # (loaded by hand or with --lora-modules): routed to their holders, loaded elsewhere from the path vLLM
    # reports (`root`). They have no limits of their own and are not in the own-or-rent report
    discover: bool = False
    # one /v1/models answer or load/unload answer, read whole: a larger one is dropped (the bounded edge)
    max_answer_bytes: int = Field(1024 * 1024, ge=4096, le=64 * 1024**2)

    @model_validator(mode="after")
    def unique(self) -> Lora:
        names = [n for a in self.adapters for n in (a.name, *a.aliases)]
        if len(set(names)) != len(names):
            raise ValueError("adapter names and aliases must be unique")
        return self


class VariantAdapter(_Strict):
    """A variant served by a LoRA adapter on its replicas (a fine-tune canaried against its base, or against its
    previous version): the variant's requests name it to vLLM, loaded on demand as a model's adapters are."""

    name: str = Field(pattern=NAME)  # vLLM's lora_name for it
    path: str | None = Field(None, min_length=1, max_length=1024)  # where vLLM loads it from; null: never loaded
    max_loras: int = Field(1, ge=1, le=1024)  # as Lora.max_loras, for the variant's replicas
    load_timeout: float = Field(30.0, gt=0, le=600)


def public_adapter_names(lora: Lora | None) -> list[str]:
    return [] if lora is None else [n for a in lora.adapters for n in (a.name, *a.aliases)]
