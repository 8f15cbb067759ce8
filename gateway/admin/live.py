"""Admin views of what changes while the gateway serves: the live policy's version and every model's replicas.

Read-only (a `viewer` token is enough); mounted under /admin with the key routes (gateway/admin/routes.py).
"""

from __future__ import annotations

from typing import Protocol

from litestar import get
from litestar.handlers import HTTPRouteHandler
from pydantic import BaseModel, ConfigDict, Field

from backends.replicas import Replica, ReplicaSet
from backends.sources.watch import Watcher
from gateway.openapi import errors
from policies.discovery import Discovery
from policies.snapshot import Snapshot


class PolicyVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(description="sha256 of the policy file's text (first 16 hex digits)")
    loaded_at: float = Field(description="unix seconds when this version was swapped in")
    path: str | None = Field(description="the watched policy file; null when the policy came from no file")
    models: list[str]


class ReplicaView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    url: str
    source: str = Field(description="static, kubernetes or kserve")
    state: str = Field(description="pending (not probed yet), unknown, up, down, or refused (never routed to)")
    draining: bool = Field(description="removed: takes no new request, finishes those in flight")
    in_flight: int
    limit: int | None = Field(description="most requests in flight to it; null: unlimited")
    reason: str | None = Field(default=None, description="why a refused endpoint is not routed to")
    ejected_by: str | None = Field(default=None, description="while outlier ejection keeps it out of routing: the"
                                   " rule that did (consecutive_failures, ttft); null while it is routed to")
    ejected_until: float | None = Field(default=None, description="unix seconds its ejection ends; null while not"
                                                                  " ejected")
    ejections: int = Field(default=0, description="ejections in a row: the backoff doubles with each, and starts"
                                                  " again once it has served well")


class WatchView(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the replica set it feeds: a model, or `model#variant`")
    source: str = Field(description="kubernetes or kserve")
    watch: str = Field(description="what it watches, e.g. `endpointslices of llm/vllm`")
    state: str = Field(description="starting (not listed yet), ok, or broken (retrying with backoff; its replicas"
                                   " stay as last seen)")
    last_sync: float | None = Field(description="unix seconds the API server was last heard from (a list, an event"
                                                " or a bookmark); null: never")
    broken_since: float | None = Field(description="unix seconds it broke; null while ok")
    failures: int = Field(description="failed lists and watches since it started")
    error: str | None = Field(description="the last failure, while broken")


WATCHES = "_watches"  # the discovery watches in /admin/replicas, beside the models: no model name starts with "_"


class Replicated(Protocol):
    """The live replica set and the discovery that feeds it (GET /admin/replicas; the console's fleet)."""

    replicas: ReplicaSet
    discovery: Discovery


class Live(Replicated, Protocol):
    """What changes while the gateway serves: the policy in force (and the file it came from) and the replicas."""

    snapshot: Snapshot
    policy_path: str | None


def live_handlers(gateway: Live) -> list[HTTPRouteHandler]:
    @get("/policy", summary="The live policy's version (hash) and when it was loaded", sync_to_thread=False,
         responses=errors(401))
    def policy_version() -> PolicyVersion:
        snapshot = gateway.snapshot
        return PolicyVersion(version=snapshot.version, loaded_at=snapshot.loaded_at, path=gateway.policy_path,
                             models=[m.name for m in snapshot.policy.models])

    @get("/replicas", summary="Every model's replicas: source, state, drain; refused endpoints and why; the discovery watches",
         description=f"One key per model (or `model#variant`) with its replicas, and `{WATCHES}`: the state of"
                     " every discovery watch (only when some model uses discovery).", sync_to_thread=False,
         responses=errors(401))
    def replicas() -> dict[str, list[ReplicaView | WatchView]]:
        return replica_views(gateway)

    return [policy_version, replicas]


def view(replica: Replica) -> ReplicaView:
    outlier = replica.outlier  # what ejection knows of it, once it failed or streamed
    ejected = outlier if outlier is not None and outlier.ejected else None
    return ReplicaView(name=replica.name, url=replica.url, source=replica.source, state=replica.state,
                       draining=replica.draining, in_flight=replica.in_flight,
                       limit=None if replica.limit is None else int(replica.limit),
                       ejected_by=ejected.rule if ejected else None,
                       ejected_until=ejected.until_unix if ejected else None,
                       ejections=outlier.ejections if outlier is not None else 0)


def watch_view(model: str, source: str, watcher: Watcher) -> WatchView:
    return WatchView(model=model, source=source, watch=watcher.name, state=watcher.state, last_sync=watcher.last_sync,
                     broken_since=watcher.broken_since, failures=watcher.failures, error=watcher.error)


def replica_views(gateway: Replicated) -> dict[str, list[ReplicaView | WatchView]]:
    """Every model's replicas, refused endpoints and discovery watches (GET /admin/replicas; the console's fleet)."""
    out: dict[str, list[ReplicaView | WatchView]] = {}
    for model, members in gateway.replicas.by_model.items():
        out[model] = [view(r) for r in members]
    for replica in gateway.replicas.draining:
        out.setdefault(replica.group, []).append(view(replica))
    for group, refused in gateway.discovery.refused.items():  # endpoints a source reports but egress refuses
        out.setdefault(group, []).extend(
            ReplicaView(name=r.name, url=r.url, source=r.source, state="refused", draining=False, in_flight=0,
                        limit=None, reason=r.reason) for r in refused.values())
    watches: list[ReplicaView | WatchView] = [watch_view(*w) for w in gateway.discovery.watches()]
    if watches:
        out[WATCHES] = watches
    return out
