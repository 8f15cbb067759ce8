"""Replicas found in a cluster (EndpointSlices, KServe) and how the gateway reaches the Kubernetes API."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from policies.config.backend import KVEventBounds
from policies.config.base import Strict

DNS_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class DiscoveredKVEvents(KVEventBounds):
    """vLLM's KV cache events of every discovered replica, for the precise-prefix scorer: each pod's vLLM binds
    (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT"}'`) and
    the gateway connects to the address the source reported for that replica, at `port`. Nothing else is
    connected to: the address is the one discovery found (and checked against network.private_cidrs)."""

    port: int = Field(ge=1, le=65535)  # where each pod's vLLM publishes (its endpoint `tcp://*:PORT`)
    # vLLM's `replay_endpoint` port (`tcp://*:PORT`, vLLM binds it): a gap in the events is asked for there
    # instead of clearing the replica's index; null: a gap clears it
    replay_port: int | None = Field(None, ge=1, le=65535)

    @model_validator(mode="after")
    def two_ports(self) -> DiscoveredKVEvents:
        if self.replay_port == self.port:
            raise ValueError("kv_events: `replay_port` must differ from `port`")
        return self


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
    kv_events: DiscoveredKVEvents | None = None  # optional: every endpoint's vLLM publishes its KV cache events

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
