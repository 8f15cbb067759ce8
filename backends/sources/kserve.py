"""`kserve`: an InferenceService (serving.kserve.io/v1beta1) by name: its predictor's endpoints while Ready.

KServe's raw-deployment mode puts the predictor behind a Service named `NAME-predictor`; its EndpointSlices
name each replica (backends/sources/kubernetes.py watches them). The InferenceService itself is listed and
watched under the kserve SDK's API names, through the same bounded client as the slices (the SDK's own
client has no timeouts): while its `Ready` condition is not True, the source reports no endpoint, so the
gateway sends it nothing new.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from backends.sources.base import Emit, Endpoint, log
from backends.sources.kubernetes import ready_endpoints, slice_watch
from backends.sources.watch import ListWatch, Watcher, WatchTimings

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


def is_ready(isvc: dict[str, Any] | None) -> bool:
    """KServe's own rule (KServeClient.is_isvc_ready): the `Ready` condition's status is True."""
    for condition in ((isvc or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return str(condition.get("status", "Unknown")).lower() == "true"
    return False


IMPORT_LOCK = threading.Lock()


def import_kserve() -> ModuleType:
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
            return importlib.import_module("kserve")
        finally:
            sys.argv = argv


class KServeSource:
    kind = "kserve"

    def __init__(self, api: ApiClient, namespace: str, name: str, port: int | str | None = None,
                 timings: WatchTimings = WatchTimings()) -> None:
        self.namespace, self.name, self.port = namespace, name, port
        self.ready = False
        self.slices: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.emit: Emit = lambda endpoints: None
        self.isvc_watch = ListWatch(f"inferenceservice {namespace}/{name}", api, self.list_isvcs(api),
                                    self.listed, self.changed, timings)
        self.slice_watch = slice_watch(api, namespace, f"{name}-predictor", self.slices_changed, timings)

    def list_isvcs(self, api: ApiClient) -> Callable[..., object]:
        """The namespace's InferenceServices (a watch of one name is a list of its namespace, filtered here).
        The kserve SDK is imported on the watch's thread, at its first list: importing it takes seconds."""
        from kubernetes import client

        custom = client.CustomObjectsApi(api)

        def call(**kwargs: Any) -> object:  # the list's or the watch's keyword arguments, passed on
            c = import_kserve().constants
            return custom.list_namespaced_custom_object(c.KSERVE_GROUP, c.KSERVE_V1BETA1_VERSION, self.namespace,
                                                        c.KSERVE_PLURAL_INFERENCESERVICE, **kwargs)
        return call

    def watchers(self) -> list[Watcher]:
        return [self.isvc_watch.watcher, self.slice_watch.watcher]

    def mine(self, item: dict[str, Any]) -> bool:
        return (item.get("metadata") or {}).get("name") == self.name

    def listed(self, items: list[dict[str, Any]]) -> None:
        self.readiness(next((i for i in items if self.mine(i)), None))

    def changed(self, kind: str, item: dict[str, Any]) -> None:
        if self.mine(item):
            self.readiness(None if kind == "DELETED" else item)

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

    def start(self, emit: Emit) -> None:
        self.emit = emit
        log.info("watching inferenceservice %s/%s and its predictor's endpoints", self.namespace, self.name)
        self.isvc_watch.watcher.start()
        self.slice_watch.watcher.start()

    def stop(self) -> None:
        self.isvc_watch.watcher.stop()
        self.slice_watch.watcher.stop()
