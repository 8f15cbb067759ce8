"""What route builders ask of a running gateway: the small Protocols that theirs are made of.

Each builder of routes (the admin API's, the console's pages, the OpenAI surface) takes the gateway through a
Protocol declared beside it that names exactly the parts it uses; the `Gateway` of gateway/wiring.py satisfies
every one by its shape, so a builder sees only those parts and a test may hand it anything that has them. The
parts that many builders read are declared here once.
"""

from __future__ import annotations

from typing import Protocol

from policies.config import Policy
from policies.store import Store


class Configured(Protocol):
    """The live policy: read at each use, as a reload replaces it whole."""

    @property
    def policy(self) -> Policy: ...


class Stored(Protocol):
    """The store of keys, teams and their usage."""

    store: Store
