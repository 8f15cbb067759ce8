"""`kubernetes`: the ready endpoints of one Service, from its EndpointSlices (discovery.k8s.io/v1), watched.

The slices of a Service carry the label `kubernetes.io/service-name`; an endpoint counts when its `ready`
condition is not false and it is not terminating (a pod on its way out drains, as production-stack does).
"""

from __future__ import annotations

import threading
from typing import Any

from backends.sources.base import Emit, Endpoint, Watcher, log

SERVICE_LABEL = "kubernetes.io/service-name"


def api_client(kubeconfig: str | None):
    """A client of the Kubernetes API: from a kubeconfig file, else the pod's service account."""
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
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


class SliceWatch:
    """Lists, then watches, the EndpointSlices of `service`; calls `changed(slices)` with all of them."""

    def __init__(self, api, namespace: str, service: str, changed) -> None:
        self.api, self.namespace, self.service, self.changed = api, namespace, service, changed
        self.watcher = Watcher(f"endpointslices of {namespace}/{service}", self.run)

    def mine(self, item: dict[str, Any]) -> bool:
        return (item.get("metadata") or {}).get("labels", {}).get(SERVICE_LABEL) == self.service

    def run(self, stopped: threading.Event) -> None:
        from kubernetes import client

        discovery = client.DiscoveryV1Api(self.api)
        selector = f"{SERVICE_LABEL}={self.service}"
        listed = self.api.sanitize_for_serialization(
            discovery.list_namespaced_endpoint_slice(self.namespace, label_selector=selector))
        slices = {i["metadata"]["name"]: i for i in listed.get("items", []) if self.mine(i)}
        self.changed(list(slices.values()))
        version = (listed.get("metadata") or {}).get("resourceVersion")
        stream = self.watcher.new_stream()
        for event in stream.stream(discovery.list_namespaced_endpoint_slice, self.namespace,
                                   label_selector=selector, timeout_seconds=300,
                                   resource_version=version if version and version.isdigit() else None):
            if stopped.is_set():
                return
            item = self.api.sanitize_for_serialization(event["object"])
            if not isinstance(item, dict) or not self.mine(item):
                continue
            name = item["metadata"]["name"]
            if event["type"] == "DELETED":
                slices.pop(name, None)
            else:
                slices[name] = item
            self.changed(list(slices.values()))


class KubernetesSource:
    kind = "kubernetes"

    def __init__(self, api, namespace: str, service: str, port: int | str | None = None) -> None:
        self.port = port
        self.emit: Emit = lambda endpoints: None
        self.watch = SliceWatch(api, namespace, service, self.slices_changed)

    def slices_changed(self, slices: list[dict[str, Any]]) -> None:
        self.emit(ready_endpoints(slices, self.port))

    def start(self, emit: Emit) -> None:
        self.emit = emit
        log.info("watching the endpoints of service %s/%s", self.watch.namespace, self.watch.service)
        self.watch.watcher.start()

    def stop(self) -> None:
        self.watch.watcher.stop()
