"""The `backends:` list of the policy file: the desired set is known at once and never changes."""

from __future__ import annotations

from backends.sources.base import Emit, Endpoint


class StaticSource:
    kind = "static"

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints

    def start(self, emit: Emit) -> None:
        emit(list(self.endpoints))

    def stop(self) -> None:
        pass
