"""One owned backend (a vLLM server): its address, cap, adaptive limit, cost and KV cache events."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.config.base import NAME, Seconds, Strict, http_url

ZMQ_TCP = r"^tcp://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\]|\*):[0-9]{1,5}$"


class Adaptive(Strict):
    """A limit that follows the live knee: it moves between `floor` and the backend's measured `cap`."""

    floor: int = Field(1, ge=1)
    target_ttft: Seconds  # time to first token the backend should keep; slower answers shrink the limit


class OwnedCost(Strict):
    """What an owned backend costs while it exists, busy or idle: GPU rent or amortised purchase, plus power."""

    per_hour: float = Field(ge=0, le=1_000_000)  # currency units per hour
    power_kw: float | None = Field(None, ge=0, le=10_000)  # average draw; priced at ledger.power_price_per_kwh


class KVEventBounds(Strict):
    """What every source of vLLM's KV cache events shares: vLLM's topic and the bounds on what it sends."""

    topic: str = Field("kv", pattern=r"^[A-Za-z0-9._-]{0,64}$")  # vLLM's `topic` (prefix-matched by ZMQ)
    # one message (one batch of events); vLLM's are a few KB: a larger one is dropped with its connection
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, le=256 * 1024**2)
    # blocks remembered for this replica (~200 bytes each; 131,072 blocks of 16 tokens cover a 2M-token cache):
    # past it the oldest stored are forgotten (copies offloaded to CPU or storage first)
    max_blocks: int = Field(131072, ge=16, le=10_000_000)


class KVEvents(KVEventBounds):
    """vLLM's KV cache events for this backend (`--kv-events-config`), read by the precise-prefix scorer.

    Exactly one of: `bind`, an address this gateway binds, with vLLM started with that same concrete address (it
    then connects to the gateway; one gateway process per address); or `connect`, the address of a vLLM started
    with `tcp://*:PORT` (it binds; any number of gateways connect)."""

    bind: str | None = Field(None, pattern=ZMQ_TCP)
    connect: str | None = Field(None, pattern=ZMQ_TCP)
    # vLLM's `replay_endpoint` (vLLM binds it): on a gap in the events the gateway asks there for the lost ones
    # instead of forgetting the replica's blocks; null: a gap clears them
    replay: str | None = Field(None, pattern=ZMQ_TCP)

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
