"""The interface every source of replicas implements, and what it reports."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("gateway.discovery")


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str  # an IP address, as the source reports it
    port: int
    ready: bool = True

    @property
    def host(self) -> str:
        """The address as a URL's host: an IPv6 one in brackets."""
        return f"[{self.address}]" if ":" in self.address else self.address

    def url(self, scheme: str) -> str:
        return f"{scheme}://{self.host}:{self.port}"


Emit = Callable[[list[Endpoint]], None]


class Source(Protocol):
    kind: str

    def start(self, emit: Emit) -> None: ...

    def stop(self) -> None: ...
