"""Where the Batch API keeps its state: files' metadata, batches, and every line's progress.

A line is pending, claimed (by one runner, until its claim expires) or done (its output or error line kept).
A runner claims lines before running them and records each result only while it still holds the line's claim,
in one atomic step that also ends the claim: so a result is written once, a line whose runner died (its claim
expired) goes back to pending and is claimed by another, and no line is lost. Two kinds, as for the keys:
SQLite for one process (policies/batches/sqlite.py), Redis for several gateway replicas
(policies/batches/redis.py); one contract suite runs against both.

Records are plain JSON objects in OpenAI's shapes (a file object, a batch object) plus fields of the gateway's
own that start with `_` (the owner's key id, `_created` (unix seconds, the listing order), the batch's model, its
creator's address, `_v` its version), dropped when shown.

A key's files count against its bounds (batch.max_files_per_key, max_bytes_per_key) in the store, in the same
atomic step that stores or forgets a file's record, so gateway replicas sharing a store enforce one bound. Each
file's `expires_at` is indexed, so a sweep finds the expired ones without reading every record.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

OPEN = ("validating", "in_progress", "finalizing", "cancelling")  # a batch's states before its last


class Progress(NamedTuple):
    pending: int
    claimed: int
    completed: int  # answered with a 2xx
    failed: int  # answered with an error (a line in the error file)


class Usage(NamedTuple):
    files: int
    bytes: int


class BatchStore(Protocol):
    async def put_file(self, record: dict[str, Any], max_files: int | None = None,
                       max_bytes: int | None = None) -> str | None:
        """Store a file's metadata (a new id, or the same output file written again) and count it against its
        owner, unless that would take the owner past `max_files` or `max_bytes` (None: no bound): then nothing is
        stored and the answer names the bound ("files" or "bytes"); None when stored."""

    async def usage(self, owner: str) -> Usage:
        """What the owner's files count: how many, how many bytes."""

    async def expired_files(self, now: float, limit: int) -> list[tuple[str, str]]:
        """Up to `limit` (owner, file id) of files whose `expires_at` is before `now`, the earliest first."""

    async def get_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """The owner's file, or None (another owner's file is None too)."""

    async def list_files(self, owner: str) -> list[dict[str, Any]]:
        """The owner's files, newest first."""

    async def delete_file(self, owner: str, file_id: str) -> bool:
        """Forget the owner's file (its count too); False when it had none of that id."""

    async def create_batch(self, record: dict[str, Any], lines: int) -> None:
        """Store a new batch and its `lines` lines (0..lines-1), all pending."""

    async def get_batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        """The owner's batch (None: any owner's, for the runner), or None."""

    async def list_batches(self, owner: str) -> list[dict[str, Any]]:
        """The owner's batches, newest first."""

    async def swap(self, record: dict[str, Any]) -> bool:
        """Replace a batch's record if nobody changed it since it was read: its `_v` (version) must still be the
        stored one; the stored record gets `_v` + 1. False (nothing written) when another change came first."""

    async def open_batches(self) -> list[dict[str, Any]]:
        """Every batch not yet in a final state, oldest first."""

    async def claim(self, batch_id: str, runner: str, count: int, until: float, now: float) -> list[int]:
        """Up to `count` lines for `runner`, claimed until `until`; claims that expired before `now` first."""

    async def renew(self, batch_id: str, runner: str, lines: list[int], until: float) -> None:
        """Extend the runner's claims on these lines (those it still holds)."""

    async def release(self, batch_id: str, runner: str, line: int) -> None:
        """Give a claimed line back to pending (it could not run now: no capacity)."""

    async def complete(self, batch_id: str, runner: str, line: int, ok: bool, result: bytes) -> bool:
        """Record a line's result, if `runner` still holds its claim: True; else nothing changes, False."""

    async def drop_pending(self, batch_id: str) -> int:
        """A cancelled or expired batch: its pending lines will never run (they count as neither result)."""

    async def progress(self, batch_id: str) -> Progress:
        """How many lines are in each state."""

    async def results(self, batch_id: str, first: int = 0, end: int | None = None) -> list[tuple[int, bool, bytes]]:
        """The recorded results (line, ok, output or error line) of lines `first` to `end` (exclusive; None: all
        of them), in line order."""

    async def close(self) -> None:
        """Release what it holds of its own (a connection, a thread)."""
