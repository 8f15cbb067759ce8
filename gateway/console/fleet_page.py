"""The fleet, live: every model's replicas with their health, cap and load (the gateway's in-flight count and
vLLM's own running, waiting and KV cache use from the scraper), each queue's depth, the routing decisions so far
and the live policy; it refreshes itself without reloading the page (htmx polling the `live` fragment). A replica
that outlier ejection keeps out of routing says by which rule and until when (the data /admin/replicas gives). An
operator may reload the policy file here, as SIGHUP would. The page opens with a summary of the fleet (replicas
up, in flight, queued, answered), refreshed with the rest."""

from __future__ import annotations

import time
from typing import Any, Protocol

from litestar import get, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import Template

from backends.replicas import split_group
from backends.vllm_stats import Scraper
from gateway.admin.live import WATCHES, Replicated, ReplicaView, replica_views
from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import page
from gateway.needs import Configured
from gateway.reload import PolicyReloader, loaded_at_iso
from policies.admission import Admission
from policies.errors import Conflict
from policies.metrics import GatewayMetrics
from policies.snapshot import Snapshot


class Fleet(Configured, Replicated, Protocol):
    """The fleet page: the replicas and the discovery watches, vLLM's figures from the scraper, the admission
    queues, the routing and request counters, the live snapshot, and the reloader of the policy file (None: the
    policy came from no file)."""

    snapshot: Snapshot
    scraper: Scraper
    metrics: GatewayMetrics
    reloader: PolicyReloader | None

    @property
    def admission(self) -> Admission: ...


def handlers(gateway: Fleet) -> list[HTTPRouteHandler]:
    def live() -> dict[str, Any]:
        replicas = {r.name: r for r in gateway.replicas}  # the live set, for vLLM's scraped figures
        queues = gateway.admission.queues
        models = []
        for group, views in replica_views(gateway).items():
            rows = []
            for v in views:
                if not isinstance(v, ReplicaView):
                    continue  # a discovery watch: listed below
                replica = replicas.get(v.name)
                stats = gateway.scraper.stats(replica) if replica is not None else None
                rows.append({"view": v, "label": readable(v.name), "running": stats.running if stats else None,
                             "waiting": stats.waiting if stats else None, "kv": stats.kv_usage if stats else None,
                             "ejected": ejection_of(v)})
            queue = queues.get(group)
            models.append({"group": group, "title": group_title(group), "replicas": rows,
                           "queued": queue.depth if queue is not None else None,
                           "up": sum(1 for v in views if isinstance(v, ReplicaView) and v.state == "up"
                                     and not v.draining),
                           "watches": [v for v in views if not isinstance(v, ReplicaView)]})
        outcomes = sorted(gateway.metrics.routing_decisions.counts.items())
        served = answered(gateway.metrics)
        return {"summary": summary_of(models, served), "models": models, "outcomes": outcomes, "answered": served, "readable": readable,
                "at": time.strftime("%H:%M:%S", time.gmtime()),
                "snapshot": gateway.snapshot, "loaded_at": loaded_at_iso(gateway.snapshot),
                "refresh": gateway.policy.console.refresh_seconds, "reloadable": gateway.reloader is not None}

    @get("/fleet")
    async def fleet(request: AnyRequest) -> Template:
        return page(request, "fleet.html", "Fleet", **live())

    @get("/fleet/live")
    async def fleet_live(request: AnyRequest) -> Template:
        return page(request, "fleet_live.html", "Fleet", **live())

    @post("/reload", opt={"role": "operator"}, status_code=200)
    async def reload(request: AnyRequest) -> Template:
        if gateway.reloader is None:
            raise Conflict("this gateway's policy came from no file: there is nothing to reload",
                           code="no_policy_file")
        outcome = await gateway.reloader.reload(f"console ({request.state.viewer.subject})", request)
        message = {"ok": "Reloaded: the new policy serves.", "unchanged": "The file has not changed.",
                   "invalid": "The file was refused (the gateway's log says why); the policy in force stays.",
                   "changing": "The file is still being written: it is applied once it has settled."}
        return page(request, "message.html", "Reload", message=message.get(outcome, outcome), ok=outcome != "invalid")

    return [fleet, fleet_live, reload]


def ejection_of(view: ReplicaView) -> dict[str, Any] | None:
    """While outlier ejection keeps a replica out of routing: the rule that did (`ejected_by`, as
    /admin/replicas says it) and when it comes back (`ejected_until`, unix seconds, and as UTC time of day)."""
    if view.ejected_by is None:
        return None
    until = view.ejected_until
    return {"rule": view.ejected_by, "until": until,
            "until_text": time.strftime("%H:%M:%S", time.gmtime(until)) if until is not None else None}


def summary_of(models: list[dict[str, Any]], served: list[tuple[tuple[str, str, str], int]]) -> dict[str, Any]:
    """The fleet's headline figures: replica sets, replicas up of all, requests in flight and queued, and the
    requests answered since start (of them, those that failed with a 5xx)."""
    replicas = [r for m in models for r in m["replicas"]]
    return {"sets": len(models), "up": sum(m["up"] for m in models), "replicas": len(replicas),
            "in_flight": sum(r["view"].in_flight for r in replicas),
            "queued": sum(m["queued"] or 0 for m in models),
            "answered": sum(n for _where, n in served),
            "failed": sum(n for (_m, _b, status), n in served if status.startswith("5"))}


def answered(metrics: GatewayMetrics) -> list[tuple[tuple[str, str, str], int]]:
    """Requests answered since start by model, where they went (a replica, a rented provider, or nowhere) and
    status: llm_gateway_requests_total summed over endpoints, in words (the metric's `unknown` model and `none`
    backend are calls refused before a model or a backend was chosen)."""
    sums: dict[tuple[str, str, str], int] = {}
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                model, backend = sample.labels["model"], sample.labels["backend"]
                where = (NO_MODEL if model == "unknown" else readable(model),
                         NOT_SENT if backend == "none" else readable(backend), sample.labels["status"])
                sums[where] = sums.get(where, 0) + int(sample.value)
    return sorted(sums.items())


NO_MODEL = "no model (refused before one was read)"
NOT_SENT = "not sent to a backend"


def readable(name: str) -> str:
    """A replica set's or replica's name as people read it: `support#base-0` is `support · base-0`."""
    model, variant = split_group(name)
    return f"{model} · {variant}" if variant else model


def group_title(group: str) -> str:
    """A replica set's caption: a model, or a model's variant (`support#base`: support, variant base)."""
    if group == WATCHES:
        return "Discovery watches"
    model, variant = split_group(group)
    return f"{model}, variant {variant}" if variant else model


PAGE = Page("fleet", "Fleet", handlers)
