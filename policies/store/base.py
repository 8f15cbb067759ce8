"""The one interface every store implements, and the errors it may raise.

The gateway keeps its shared state behind `Store` so one process can run on an embedded SQLite file and N
replicas can share Redis without any caller knowing which. Today it holds API-key records and the usage
ledger; rate-limit state will join as further methods on the same interface (SQLite's side keeps limits in
memory, Redis enforces them with Lua), so callers keep passing around one object.

Errors (every failure a caller sees is one of these, never a driver's own exception):

    StoreError             anything the store could not do
    ├── StoreUnavailable   the backing server or file cannot be reached right now: the gateway answers 503
    ├── KeyExists          create_key with an id that is already taken
    ├── KeyNotFound        put_key for an id that has no record
    ├── TeamExists         create_team with a name that is already taken
    └── TeamNotFound       put_team or delete_team for a name that has no record

Messages name the operation, never a stored value.

Usage is all-time totals per (key, model). `requests`, `prompt_tokens` and `completion_tokens` count every
request; the `rented_*` counters count the subset that overflowed to a rented provider, so owned traffic is
the difference. Every model row carries all of USAGE_FIELDS, zeros included.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from policies.keys import KeyRecord
from policies.teams import TeamRecord

SECRET_BYTES = 32  # of a shared_secret
USAGE_FIELDS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "rented_requests",
    "rented_prompt_tokens",
    "rented_completion_tokens",
)


class StoreError(Exception):
    """The store could not do what was asked."""


class StoreUnavailable(StoreError):
    """The backing server (or database file) cannot be reached; retrying later may work."""


class KeyExists(StoreError):
    """A record with this id already exists."""


class KeyNotFound(StoreError):
    """No record has this id."""


class TeamExists(StoreError):
    """A team with this name already exists."""


class TeamNotFound(StoreError):
    """No team has this name."""


@runtime_checkable
class Store(Protocol):
    """Keys and usage, shared by everything that serves or administers the gateway."""

    async def create_key(self, record: KeyRecord) -> None:
        """Store a new record; raise KeyExists if its id is taken."""

    async def get_key(self, key_id: str) -> KeyRecord | None:
        """The record with this id, or None. last_used_at is the latest of the record's and touch_key's."""

    async def list_keys(self) -> list[KeyRecord]:
        """Every record, oldest created_at first (ties by id)."""

    async def put_key(self, record: KeyRecord) -> None:
        """Replace an existing record (update, revoke, rotate); raise KeyNotFound if there is none."""

    async def create_team(self, team: TeamRecord) -> None:
        """Store a new team; raise TeamExists if its name is taken."""

    async def get_team(self, name: str) -> TeamRecord | None:
        """The team with this name, or None."""

    async def list_teams(self) -> list[TeamRecord]:
        """Every team, by name."""

    async def put_team(self, team: TeamRecord) -> None:
        """Replace an existing team; raise TeamNotFound if there is none."""

    async def delete_team(self, name: str) -> None:
        """Remove a team; raise TeamNotFound if there is none. Its keys are the caller's business."""

    async def touch_key(self, key_id: str, when: float) -> None:
        """Note that the key was used at `when`; keeps the latest time. A missing id is ignored."""

    async def add_usage(
        self,
        key_id: str,
        model: str,
        *,
        requests: int,
        prompt_tokens: int,
        completion_tokens: int,
        rented: bool = False,
    ) -> None:
        """Add to the key's totals for `model`; when `rented`, also to its rented_* counters."""

    async def usage(self, key_id: str) -> dict[str, dict[str, int]]:
        """{model: {field: total}} for every model the key has used, each with all of USAGE_FIELDS."""

    async def shared_secret(self, name: str) -> bytes:
        """32 random bytes under `name`, made by the first caller and the same for every later one (every
        gateway replica on this store): a key for tags the replicas must check without asking the store."""

    async def ping(self) -> None:
        """Return if the store is reachable; raise StoreUnavailable if not."""

    async def close(self) -> None:
        """Release connections and threads; calling it twice is harmless."""


def usage_increments(requests: int, prompt_tokens: int, completion_tokens: int, rented: bool) -> dict[str, int]:
    """The counters one add_usage call moves, validated: the ledger only grows."""
    if min(requests, prompt_tokens, completion_tokens) < 0:
        raise ValueError("usage increments must not be negative")
    deltas = {"requests": requests, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    if rented:
        deltas |= {f"rented_{name}": value for name, value in list(deltas.items())}
    return deltas


def empty_usage() -> dict[str, int]:
    return dict.fromkeys(USAGE_FIELDS, 0)


def with_last_used(record: KeyRecord, touched: float | None) -> KeyRecord:
    """The record with last_used_at raised to `touched` (kept apart from the record so touching is cheap)."""
    if touched is None or (record.last_used_at is not None and record.last_used_at >= touched):
        return record
    return record.model_copy(update={"last_used_at": touched})
