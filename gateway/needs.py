"""What route builders ask of a running gateway: the small Protocols that theirs are made of.

Each builder of routes (the admin API's, the console's pages, the OpenAI surface) takes the gateway through a
Protocol declared beside it that names exactly the parts it uses; the `Gateway` of gateway/wiring.py satisfies
every one by its shape, so a builder sees only those parts and a test may hand it anything that has them. The
parts that many builders read are declared here once.
"""

from __future__ import annotations

from typing import Protocol

from policies.batches.service import Batches
from policies.config import Policy
from policies.keys import KeyRecord
from policies.store import Store


class Configured(Protocol):
    """The live policy: read at each use, as a reload replaces it whole."""

    @property
    def policy(self) -> Policy: ...


class Stored(Protocol):
    """The store of keys, teams and their usage."""

    store: Store


class BatchGateway(Configured, Protocol):
    """What the Files and Batch routes ask of the gateway (gateway/endpoints/files.py, batches.py): the live
    policy, the Batch API's service (None while the policy leaves it off) and the runner's wake-up."""

    batches: Batches | None

    def batch_runner_wake(self) -> None: ...


class Models(Protocol):
    """What the model routes ask of the gateway (gateway/endpoints/models.py)."""

    def models_listing(self, key: KeyRecord) -> bytes: ...

    def model_entry(self, key: KeyRecord, name: str) -> bytes | None: ...


class Answering(BatchGateway, Models, Protocol):
    """What the routes the gateway answers itself (`Route.answer`: the model list, files, batches) ask of it:
    each route's `answer` takes the Protocol it names, and the edge hands it the whole."""
