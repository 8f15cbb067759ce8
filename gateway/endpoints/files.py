"""The Files API for batches: POST /v1/files (multipart: `file` and `purpose`), GET /v1/files, GET/DELETE
/v1/files/{id} and GET /v1/files/{id}/content, answered by the gateway itself from the Batch API's state
(policies/batches/). A file is its key's alone: another key's id answers 404, as an unknown one does."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import orjson
from multipart import (
    MultipartError,
    MultipartSegment,
    PushMultipartParser,
    parse_options_header,
)

from gateway.endpoints.base import MULTIPART, NONE, Asked, Download, Route
from gateway.needs import BatchGateway
from policies.batches.service import Batches, expires_after
from policies.config import Policy
from policies.errors import BadRequest, NotFound, StateUnavailable
from policies.keys import KeyRecord
from policies.store import StoreUnavailable

T = TypeVar("T")
MAX_QUERY = 1024
FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")  # as the openai SDK sends them


def service(gateway: BatchGateway) -> Batches:
    if gateway.batches is None:
        raise NotFound("the Batch API is not enabled on this gateway", code="unknown_url")
    return gateway.batches


async def stored(operation: Awaitable[T]) -> T:
    """A store that cannot be reached is the 503 every route gives for it."""
    try:
        return await operation
    except StoreUnavailable:
        raise StateUnavailable("the batch store is unavailable; try again shortly") from None


def query_of(raw: bytes, allowed: tuple[str, ...]) -> dict[str, str]:
    if len(raw) > MAX_QUERY:
        raise BadRequest("the query string is too long", code="invalid_query")
    try:
        pairs = parse_qsl(raw.decode("ascii"), strict_parsing=bool(raw), max_num_fields=16)
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("the query string is malformed", code="invalid_query") from None
    found = {}
    for name, value in pairs:
        if name not in allowed:
            raise BadRequest(f"unknown query parameter '{name[:64]}'", param=name[:64], code="invalid_query")
        found[name] = value[:200]
    return found


def limit_of(query: dict[str, str], default: int, most: int) -> int:
    value = query.get("limit")
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise BadRequest(f"limit must be an integer from 1 to {most}", param="limit", code="invalid_query")
    return int(value)


async def read_form(stream: AsyncIterator[bytes], content_type: str,
                    on_file: Callable[[dict[str, str], bytes], Awaitable[None]]) -> tuple[dict[str, str], str | None]:
    """The text fields and the name of the one file of a multipart body as it arrives; the file's bytes go to
    `on_file` (with the fields read so far) piece by piece, never held whole."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get("boundary", "")
    if kind != "multipart/form-data" or not 0 < len(boundary) <= 200:
        raise BadRequest("the request body must be multipart/form-data with a boundary", code="invalid_content_type")
    parser = PushMultipartParser(boundary.encode("latin-1"), max_header_count=16)
    fields: dict[str, str] = {}
    filename: str | None = None
    segment: MultipartSegment | None = None
    parts: list[bytes] = []
    into_file = False  # the segment being read is the file
    try:
        async for chunk in chained(stream, b""):
            for event in parser.parse(chunk):
                if isinstance(event, MultipartSegment):
                    segment, parts = event, []
                    into_file = event.name == "file" and event.filename is not None and filename is None
                    if into_file:
                        filename = event.filename
                elif event is None and segment is not None:
                    if not into_file and segment.name in FIELDS and segment.filename is None:
                        fields[segment.name] = b"".join(parts)[:64].decode("utf-8", "replace")
                    segment, into_file = None, False
                elif into_file:
                    await on_file(fields, bytes(event))
                elif segment is not None and segment.name in FIELDS and sum(map(len, parts)) < 64:
                    parts.append(bytes(event))
        if not parser.closed:
            raise BadRequest("the multipart body ended early", code="invalid_multipart")
    except MultipartError as exc:
        raise BadRequest(f"the request body is not valid multipart/form-data: {str(exc)[:200]}",
                         code="invalid_multipart") from None
    return fields, filename


async def chained(stream: AsyncIterator[bytes], last: bytes) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk
    yield last


def model_refusal(gateway: BatchGateway, key: KeyRecord) -> Callable[[str], str | None]:
    """Why `key` may not use a model a file's lines name (None: it may), as the model and authorize steps say."""
    def refusal(model: str) -> str | None:
        entry = next((m for m in gateway.policy.models if model == m.name or model in m.aliases), None)
        if entry is None:
            return f"the model {model[:200]!r} does not exist or you do not have access to it"
        if key.models is not None and entry.name not in key.models:
            return f"this API key may not use model {entry.name}"
        return None

    return refusal


async def create(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    """An upload streamed to the volume as it arrives, its lines checked on the way (at most one line and a
    megabyte of it held in memory, whatever its size); kept once whole, checked and within the key's bounds."""
    batches = service(gateway)
    check = batches.line_check(model_refusal(gateway, key))
    if asked.stream is None:
        raise BadRequest("the request body must be multipart/form-data", code="invalid_content_type")
    async with batches.files.incoming() as incoming:
        async def on_file(fields: dict[str, str], piece: bytes) -> None:
            if not incoming.size and "purpose" in fields:  # sent before the file (the SDK does): refused at once
                batches.check_purpose(fields["purpose"])
            check.feed(piece)
            await incoming.write(piece)

        fields, filename = await read_form(asked.stream, asked.headers.get("content-type", ""), on_file)
        if "purpose" not in fields:
            raise BadRequest("the form must have a 'purpose' field", param="purpose", code="missing_field")
        if filename is None:
            raise BadRequest("the form must have a 'file' part with a filename", param="file", code="missing_field")
        batches.check_purpose(fields["purpose"])
        keep = expires_after(fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]"))
        record = await stored(batches.upload(key.id, filename, fields["purpose"], incoming, check.end(), keep))
    return orjson.dumps(record)


async def listing(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    query = query_of(asked.query, ("purpose", "limit", "after", "order"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be asc or desc", param="order", code="invalid_query")
    found = await stored(service(gateway).list_files(key.id, query.get("purpose"), query.get("after"),
                                                     limit_of(query, 10_000, 10_000), order))
    return orjson.dumps(found)


async def retrieve(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    return orjson.dumps(shown_file(await stored(service(gateway).file(key.id, asked.params["id"]))))


def shown_file(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("_")}


async def delete(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    return orjson.dumps(await stored(service(gateway).delete(key.id, asked.params["id"])))


async def content(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> Download:
    """A file's bytes sent a megabyte at a time from the volume (each read off the event loop), never held whole."""
    mapped = await stored(service(gateway).content(key.id, asked.params["id"]))
    return Download(len(mapped), pieces_of(mapped))


async def pieces_of(mapped: mmap.mmap, size: int = 1 << 20) -> AsyncGenerator[bytes, None]:
    try:
        for at in range(0, len(mapped), size):
            yield await asyncio.to_thread(mapped.__getitem__, slice(at, at + size))
    finally:
        mapped.close()


def max_upload(policy: Policy) -> int:
    return policy.batch.max_file_bytes + 64 * 1024  # the file and the form around it


CREATE = Route("files", "/v1/files", body=MULTIPART, answer=create, max_body=max_upload)
LIST = Route("files/list", "/v1/files", methods=("GET",), body=NONE, answer=listing)
RETRIEVE = Route("files/retrieve", "/v1/files/{id}", methods=("GET",), body=NONE, answer=retrieve)
DELETE = Route("files/delete", "/v1/files/{id}", methods=("DELETE",), body=NONE, answer=delete)
CONTENT = Route("files/content", "/v1/files/{id}/content", methods=("GET",), body=NONE, answer=content,
                answer_type="application/octet-stream")
