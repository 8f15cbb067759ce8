"""`kserve`: an InferenceService (serving.kserve.io/v1beta1) by name: its predictor's endpoints while Ready.

KServe's raw-deployment mode puts the predictor behind a Service named `NAME-predictor`; its EndpointSlices
name each replica (backends/sources/kubernetes.py watches them). The InferenceService itself is read with the
kserve SDK's client and watched: while its `Ready` condition is not True, the source reports no endpoint, so
the gateway sends it nothing new.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from backends.sources.base import Emit, Endpoint, Watcher, log
from backends.sources.kubernetes import SliceWatch, ready_endpoints


def is_ready(isvc: dict[str, Any] | None) -> bool:
    """KServe's own rule (KServeClient.is_isvc_ready): the `Ready` condition's status is True."""
    for condition in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return str(condition.get("status", "Unknown")).lower() == "true"
    return False


IMPORT_LOCK = threading.Lock()


def import_kserve():
    """The kserve SDK, imported with an argv of the program's name alone.

    Importing `kserve` imports its model server, which parses sys.argv at module level (parse_known_args) and
    exits on what it cannot parse: the gateway's own `serve --config FILE` reads to it as an abbreviation of
    its `--configure_logging`, and the watch thread died with a usage message. Nothing reads sys.argv after
    the gateway has started, so lending it for the import is safe."""
    with IMPORT_LOCK:
        if "kserve" in sys.modules:
            return sys.modules["kserve"]
        argv = sys.argv
        sys.argv = argv[:1]
        try:
            import kserve
        finally:
            sys.argv = argv
        return kserve


def kserve_client(kubeconfig: str | None):
    kserve = import_kserve()
    return kserve.KServeClient(config_file=kubeconfig) if kubeconfig else kserve.KServeClient()


class KServeSource:
    kind = "kserve"

    def __init__(self, api, kubeconfig: str | None, namespace: str, name: str, port: int | str | None = None) -> None:
        self.kubeconfig, self.namespace, self.name, self.port = kubeconfig, namespace, name, port
        self.kserve = None  # the SDK's client, made in the watch thread: importing kserve takes seconds
        self.ready = False
        self.slices: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.emit: Emit = lambda endpoints: None
        self.isvc_watch = Watcher(f"inferenceservice {namespace}/{name}", self.run)
        self.slice_watch = SliceWatch(api, namespace, f"{name}-predictor", self.slices_changed)

    def endpoints(self) -> list[Endpoint]:
        return ready_endpoints(self.slices, self.port) if self.ready else []

    def slices_changed(self, slices: list[dict[str, Any]]) -> None:
        with self.lock:
            self.slices = slices
            self.emit(self.endpoints())

    def readiness(self, isvc: dict[str, Any] | None) -> None:
        with self.lock:
            ready = is_ready(isvc)
            if ready != self.ready:
                log.info("inferenceservice %s/%s is %s", self.namespace, self.name,
                         "Ready" if ready else "not Ready: no new requests go to it")
            self.ready = ready
            self.emit(self.endpoints())

    def run(self, stopped: threading.Event) -> None:
        from kubernetes.client.exceptions import ApiException

        if self.kserve is None:
            self.kserve = kserve_client(self.kubeconfig)
        constants = import_kserve().constants
        try:
            self.readiness(self.kserve.get(self.name, namespace=self.namespace))
        except (RuntimeError, ApiException):  # the SDK wraps a 404 in RuntimeError: not there (yet)
            self.readiness(None)
        stream = self.isvc_watch.new_stream()
        for event in stream.stream(self.kserve.api_instance.list_namespaced_custom_object, constants.KSERVE_GROUP,
                                   constants.KSERVE_V1BETA1_VERSION, self.namespace,
                                   constants.KSERVE_PLURAL_INFERENCESERVICE, timeout_seconds=300):
            if stopped.is_set():
                return
            item = event["object"]
            if not isinstance(item, dict) or (item.get("metadata") or {}).get("name") != self.name:
                continue
            self.readiness(None if event["type"] == "DELETED" else item)

    def start(self, emit: Emit) -> None:
        self.emit = emit
        log.info("watching inferenceservice %s/%s and its predictor's endpoints", self.namespace, self.name)
        self.isvc_watch.start()
        self.slice_watch.watcher.start()

    def stop(self) -> None:
        self.isvc_watch.stop()
        self.slice_watch.watcher.stop()
