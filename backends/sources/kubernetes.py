"""`kubernetes`: the ready endpoints of one Service, from its EndpointSlices (discovery.k8s.io/v1), watched.

The slices of a Service carry the label `kubernetes.io/service-name`; an endpoint counts when its `ready`
condition is not false and it is not terminating (a pod on its way out drains, as production-stack does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.sources.base import Emit, Endpoint, log
from backends.sources.watch import ListWatch, Watcher, WatchTimings

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

SERVICE_LABEL = "kubernetes.io/service-name"


def api_client(kubeconfig: str | None) -> ApiClient:
    """A client of the Kubernetes API: from a kubeconfig file, else the pod's service account.

    urllib3's own retries are off: every watch retries with backoff itself (backends/sources/watch.py), and
    urllib3's retry warnings were ~4 lines a second while the API server was down. TCP keepalive is on (the
    client's defaults, client-go's: probes after 30 s idle), so the kernel too drops a flow that died."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.retries = False
    configuration.keep_alive = True
    return client.ApiClient(configuration)


def ready_endpoints(slices: list[dict[str, Any]], port: int | str | None) -> list[Endpoint]:
    """The ready endpoints of a Service's slices (as JSON), at `port` (a number, a port name, or the first)."""
    out: dict[tuple[str, int], Endpoint] = {}
    for item in slices:
        number = slice_port(item.get("ports") or [], port)
        if number is None:
            continue
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for address in endpoint.get("addresses") or []:
                out.setdefault((address, number), Endpoint(address, number))
    return sorted(out.values(), key=lambda e: (e.address, e.port))


def slice_port(ports: list[dict[str, Any]], wanted: int | str | None) -> int | None:
    for p in ports:
        if wanted is None or wanted == p.get("port") or wanted == p.get("name"):
            return p.get("port")
    return None


def slice_watch(api: ApiClient, namespace: str, service: str, changed: Callable[[list[dict[str, Any]]], None],
                timings: WatchTimings) -> ListWatch:
    """Lists, then watches, the EndpointSlices of `service`; calls `changed(slices)` with all of them."""
    from kubernetes import client

    slices: dict[str, dict[str, Any]] = {}

    def mine(item: dict[str, Any]) -> bool:
        return ((item.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL) == service

    def listed(items: list[dict[str, Any]]) -> None:
        slices.clear()
        slices.update({i["metadata"]["name"]: i for i in items if mine(i)})
        changed(list(slices.values()))

    def event(kind: str, item: dict[str, Any]) -> None:
        if not mine(item):
            return
        if kind == "DELETED":
            slices.pop(item["metadata"]["name"], None)
        else:
            slices[item["metadata"]["name"]] = item
        changed(list(slices.values()))

    discovery = client.DiscoveryV1Api(api)
    return ListWatch(f"endpointslices of {namespace}/{service}", api,
                     lambda **kw: discovery.list_namespaced_endpoint_slice(namespace, **kw), listed, event, timings,
                     label_selector=f"{SERVICE_LABEL}={service}")


class KubernetesSource:
    kind = "kubernetes"

    def __init__(self, api: ApiClient, namespace: str, service: str, port: int | str | None = None,
                 timings: WatchTimings = WatchTimings()) -> None:
        self.namespace, self.service, self.port = namespace, service, port
        self.emit: Emit = lambda endpoints: None
        self.watch = slice_watch(api, namespace, service, self.slices_changed, timings)

    def watchers(self) -> list[Watcher]:
        return [self.watch.watcher]

    def slices_changed(self, slices: list[dict[str, Any]]) -> None:
        self.emit(ready_endpoints(slices, self.port))

    def start(self, emit: Emit) -> None:
        self.emit = emit
        log.info("watching the endpoints of service %s/%s", self.namespace, self.service)
        self.watch.watcher.start()

    def stop(self) -> None:
        self.watch.watcher.stop()
