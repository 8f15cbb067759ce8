"""The Batch API's operations, each scoped to the key that calls (the design's tenancy): a file or batch of
another key answers as one that does not exist. Records are OpenAI's file and batch objects plus the gateway's
own `_` fields (policies/batches/store.py), which `shown` drops."""

from __future__ import annotations

import mmap
import secrets
import time
from collections.abc import Callable
from typing import Any

from policies.config.batches import BatchSettings
from policies.batches.files import FileDir, Incoming
from policies.batches.jsonl import ENDPOINTS, LineCheck, Summary
from policies.batches.store import OPEN, BatchStore
from policies.errors import BadRequest, NotFound
from policies.json_types import is_int

PURPOSES = ("batch",)  # what a client may upload; `batch_output` files are the gateway's own
WINDOWS = {"24h": 86400}
MAX_METADATA = 16
MAX_FILENAME = 256
EXPIRES_AFTER = (3600, 2_592_000)  # what an upload's `expires_after.seconds` may say: OpenAI's range, 1 h to 30 days


def shown(record: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in record.items() if not k.startswith("_")}
    if out.get("object") == "batch":  # (a batch stored before these were kept: its lines' model, no usage yet)
        out.setdefault("model", record.get("_model"))
        out.setdefault("usage", no_usage())
    return out


def no_usage() -> dict[str, Any]:
    """A batch's `usage` before any line is counted: OpenAI's shape, all zeros."""
    return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


def add_usage(total: dict[str, Any], answer: Any) -> None:
    """Add one answered line's token usage (a chat or completions `usage`, an embeddings one, or a Responses one)
    to a batch's `usage`."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return

    def count(*path: str) -> int:
        value: Any = usage
        for name in path:
            value = value.get(name) if isinstance(value, dict) else None
        return value if is_int(value) else 0

    given = count("prompt_tokens") or count("input_tokens")
    made = count("completion_tokens") or count("output_tokens")
    total["input_tokens"] += given
    total["output_tokens"] += made
    total["total_tokens"] += count("total_tokens") or given + made
    total["input_tokens_details"]["cached_tokens"] += \
        count("prompt_tokens_details", "cached_tokens") or count("input_tokens_details", "cached_tokens")
    total["output_tokens_details"]["reasoning_tokens"] += \
        count("completion_tokens_details", "reasoning_tokens") or count("output_tokens_details", "reasoning_tokens")


def no_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id[:100]}", param="file_id", code="file_not_found")


def no_batch(batch_id: str) -> NotFound:
    return NotFound(f"No batch found with id '{batch_id[:100]}'.", param="batch_id", code="batch_not_found")


def live(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record, unless it expired: an expired file answers as an unknown one even before the sweep deletes it."""
    if record is None or (record.get("expires_at") is not None and record["expires_at"] <= time.time()):
        return None
    return record


def expires_after(anchor: str | None, seconds: str | None, name: str = "expires_after") -> int | None:
    """An upload's `expires_after` (anchor, seconds as the form sent them): the seconds it asks for, or None when
    it asks for nothing. Anything but OpenAI's `created_at` anchor and 3600 to 2592000 seconds is a 400."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise BadRequest(f"{name}[anchor] must be created_at", param=f"{name}[anchor]", code="invalid_expires_after")
    low, high = EXPIRES_AFTER
    if seconds is None or not seconds.isdigit() or not low <= int(seconds) <= high:
        raise BadRequest(f"{name}[seconds] must be an integer from {low} to {high}", param=f"{name}[seconds]",
                         code="invalid_expires_after")
    return int(seconds)


def output_expires_after(asked: Any) -> int | None:
    """A batch's `output_expires_after` (JSON: {"anchor": "created_at", "seconds": N}): how long its output and
    error files are kept from when they are written, or None (batch.output_retention_seconds); as an upload's."""
    name = "output_expires_after"
    if asked is None:
        return None
    if not isinstance(asked, dict):
        raise BadRequest(f"{name} must be an object with anchor and seconds", param=name, code="invalid_expires_after")
    seconds = asked.get("seconds")
    whole = is_int(seconds)
    return expires_after(asked.get("anchor"), str(seconds) if whole else "not an integer", name)


def page(records: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: newest first, the ones after the id `after`."""
    if after is not None:
        index = next((i for i, r in enumerate(records) if r["id"] == after), None)
        records = records[index + 1:] if index is not None else []
    data = [shown(r) for r in records[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit}


class Batches:
    def __init__(self, store: BatchStore, settings: Callable[[], BatchSettings]) -> None:
        self.store = store
        self.settings = settings  # the live policy's (a reload may change them)

    @property
    def files(self) -> FileDir:
        return FileDir(self.settings().files_dir)

    @staticmethod
    def check_purpose(purpose: str) -> None:
        if purpose not in PURPOSES:
            raise BadRequest(f"purpose must be one of: {', '.join(PURPOSES)}", param="purpose", code="invalid_purpose")

    def line_check(self, refusal: Callable[[str], str | None]) -> LineCheck:
        """What checks an upload's lines as they arrive (policies/batches/jsonl.py), by the live settings."""
        settings = self.settings()
        return LineCheck(settings.max_lines, settings.max_line_bytes, refusal)

    async def upload(self, owner: str, filename: str, purpose: str, incoming: Incoming, summary: Summary,
                     keep_seconds: int | None = None) -> dict[str, Any]:
        """Keep an upload whose bytes are in `incoming` (FileDir.incoming, on the volume but not yet a file) and
        whose lines `summary` says were checked, for `keep_seconds` (None: batch.file_retention_seconds). Its
        record is stored, counted against the key's bounds, before the bytes become a file: an upload past a
        bound leaves nothing on the volume (`incoming` is removed on the way out); if that last step fails the
        record goes with it."""
        self.check_purpose(purpose)
        settings = self.settings()
        file_id = f"file-{secrets.token_hex(12)}"
        now = int(time.time())
        record = {"id": file_id, "object": "file", "bytes": incoming.size, "created_at": now,
                  "filename": filename[:MAX_FILENAME], "purpose": purpose, "status": "processed",
                  "expires_at": now + (keep_seconds or settings.file_retention_seconds),
                  "status_details": None, "_owner": owner, "_created": time.time(), "_lines": summary.lines,
                  "_url": summary.url, "_model": summary.model}
        bound = await self.store.put_file(record, settings.max_files_per_key, settings.max_bytes_per_key)
        if bound is not None:
            raise await self.past_bound(owner, bound, incoming.size)
        try:
            await incoming.keep(file_id)
        except Exception:
            await self.store.delete_file(owner, file_id)
            raise
        return shown(record)

    async def past_bound(self, owner: str, bound: str, size: int) -> BadRequest:
        """A 400 naming the key's bound an upload would cross, and what the key holds now. A 400 rather than a 413:
        the upload itself is within max_file_bytes, and deleting files (or their expiry) makes room for it."""
        settings, usage = self.settings(), await self.store.usage(owner)
        if bound == "files":
            return BadRequest(f"this key has {usage.files} files; one more would pass batch.max_files_per_key "
                              f"({settings.max_files_per_key}): delete some or wait for them to expire",
                              param="file", code="file_count_limit_reached")
        return BadRequest(f"this key's files hold {usage.bytes} bytes; {size} more would pass "
                          f"batch.max_bytes_per_key ({settings.max_bytes_per_key}): delete some or wait for them to "
                          "expire", param="file", code="storage_limit_reached")

    async def file(self, owner: str, file_id: str) -> dict[str, Any]:
        record = live(await self.store.get_file(owner, file_id))
        if record is None:
            raise no_file(file_id)
        return record

    async def content(self, owner: str, file_id: str) -> mmap.mmap:
        """The file's bytes mapped from the volume (close the map when done)."""
        await self.file(owner, file_id)
        data = await self.files.mapped(file_id)
        if data is None:
            raise no_file(file_id)
        return data

    async def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        if not await self.store.delete_file(owner, file_id):
            raise no_file(file_id)
        await self.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                         order: str = "desc") -> dict[str, Any]:
        records = [r for r in await self.store.list_files(owner)
                   if live(r) and (purpose is None or r["purpose"] == purpose)]
        return page(records[::-1] if order == "asc" else records, after, limit)

    async def create(self, owner: str, client_host: str, body: dict[str, Any]) -> dict[str, Any]:
        file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
        if not isinstance(file_id, str) or not file_id:
            raise BadRequest("'input_file_id' must name an uploaded file", param="input_file_id")
        if endpoint not in ENDPOINTS:
            raise BadRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint",
                             code="invalid_endpoint")
        if window not in WINDOWS:
            raise BadRequest("'completion_window' must be 24h", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
            raise BadRequest(f"'metadata' must be an object of at most {MAX_METADATA} string pairs", param="metadata")
        keep_output = output_expires_after(body.get("output_expires_after"))
        source = live(await self.store.get_file(owner, file_id))
        if source is None or source["purpose"] != "batch":
            raise NotFound(f"No such File object: {file_id[:100]}", param="input_file_id", code="file_not_found")
        if source["_url"] != endpoint:
            raise BadRequest(f"the file's lines are for {source['_url']}, not the batch's endpoint {endpoint}",
                             param="endpoint", code="mismatched_endpoint")
        settings = self.settings()
        queued = await self.queued_lines(owner)
        if queued + source["_lines"] > settings.max_queued_lines_per_key:
            raise BadRequest(f"this key has {queued} lines queued in open batches; {source['_lines']} more would pass"
                             f" the limit of {settings.max_queued_lines_per_key}", param="input_file_id",
                             code="queued_lines_limit_reached")
        now = int(time.time())
        record = {"id": f"batch_{secrets.token_hex(12)}", "object": "batch", "endpoint": endpoint, "errors": None,
                  "input_file_id": file_id, "completion_window": window, "status": "validating",
                  "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                  "expires_at": now + min(WINDOWS[window], int(settings.completion_window_seconds)),
                  "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
                  "cancelling_at": None, "cancelled_at": None,
                  "request_counts": {"total": source["_lines"], "completed": 0, "failed": 0},
                  "model": source["_model"], "usage": no_usage(), "metadata": metadata, "_owner": owner, "_created": time.time(), "_client": client_host, "_model": source["_model"], "_v": 0,
                  "_keep_output": keep_output}
        await self.store.create_batch(record, source["_lines"])
        return shown(record)

    async def queued_lines(self, owner: str) -> int:
        total = 0
        for record in await self.store.open_batches():
            if record["_owner"] == owner:
                progress = await self.store.progress(record["id"])
                total += progress.pending + progress.claimed
        return total

    async def batch(self, owner: str, batch_id: str) -> dict[str, Any]:
        record = await self.store.get_batch(owner, batch_id)
        if record is None:
            raise no_batch(batch_id)
        return await self.counted(record)

    async def counted(self, record: dict[str, Any]) -> dict[str, Any]:
        """An open batch's request counts as they are now."""
        if record["status"] in OPEN:
            progress = await self.store.progress(record["id"])
            record["request_counts"] = {"total": record["request_counts"]["total"],
                                        "completed": progress.completed, "failed": progress.failed}
        return shown(record)

    async def list_batches(self, owner: str, after: str | None, limit: int) -> dict[str, Any]:
        return page(await self.store.list_batches(owner), after, limit)

    async def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        for _ in range(20):  # a runner may change the record between our read and our write: read it again
            record = await self.store.get_batch(owner, batch_id)
            if record is None:
                raise no_batch(batch_id)
            if record["status"] not in ("validating", "in_progress"):
                return await self.counted(record)  # already ending or ended: cancelling again changes nothing
            record["status"], record["cancelling_at"] = "cancelling", int(time.time())
            if await self.store.swap(record):
                return await self.counted(record)
        raise BadRequest("the batch is changing too often to cancel now; try again", code="conflict")
