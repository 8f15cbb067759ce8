"""A batch input file read line by line, as OpenAI reads one: each line a JSON object with `custom_id`, `method`
(POST), `url` (one of ENDPOINTS) and `body` (an object naming `model`); custom_ids unique; one url and one model
for the whole file. The first problem is a 400 naming its line (counted from 1), so the client can fix it."""

from __future__ import annotations

import mmap
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import orjson

from policies.errors import BadRequest
from policies.json_depth import json_too_deep, nests_past_bound

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID = 512

_NOT_BLANK = re.compile(rb"[^ \t\n\r\x0b\x0c]")  # a byte that bytes.strip() keeps: a line without one is blank


@dataclass(frozen=True)
class Summary:
    lines: int
    url: str
    model: str


def bad_line(number: int, message: str, code: str = "invalid_batch_line") -> BadRequest:
    return BadRequest(f"line {number}: {message}", param="file", code=code)


def read_lines(data: bytes, max_lines: int, max_line_bytes: int,
               model_refusal: Callable[[str], str | None]) -> Summary:
    """Check a whole input file (LineCheck fed it at once)."""
    check = LineCheck(max_lines, max_line_bytes, model_refusal)
    check.feed(data)
    return check.end()


class LineCheck:
    """Checks an input file as its bytes arrive (an upload streamed to the volume): `feed` each chunk, `end` once
    they are all in for the Summary. `model_refusal(model)` says why the uploading key may not use a model (None:
    it may). Raises BadRequest naming the first bad line as soon as it is whole, or as soon as a line grows past
    `max_line_bytes`; what it holds is at most one unfinished line, kept in pieces (no piece is copied twice)."""

    def __init__(self, max_lines: int, max_line_bytes: int, model_refusal: Callable[[str], str | None]) -> None:
        self.max_lines, self.max_line_bytes, self.model_refusal = max_lines, max_line_bytes, model_refusal
        self.seen: set[str] = set()
        self.url = self.model = ""
        self.count = 0  # lines that are not blank
        self.number = 0  # lines ended so far, blank ones too: an error names the line as an editor counts it
        self.pieces: list[bytes] = []  # the unfinished line
        self.held = 0

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            if self.pieces:
                self.pieces.append(piece)
                piece, self.pieces, self.held = b"".join(self.pieces), [], 0
            self._line(piece)
            start = end + 1
        if start < len(chunk):
            self.pieces.append(chunk[start:])
            self.held += len(chunk) - start
            if self.held > self.max_line_bytes:
                raise self._too_long(self.number + 1)

    def end(self) -> Summary:
        if self.pieces:
            raw, self.pieces, self.held = b"".join(self.pieces), [], 0
            self._line(raw)
        if self.count == 0:
            raise BadRequest("the file has no lines: a batch input file holds one JSON request per line",
                             param="file", code="empty_file")
        return Summary(self.count, self.url, self.model)

    def _too_long(self, number: int) -> BadRequest:
        return bad_line(number, f"the line is longer than the {self.max_line_bytes} bytes this gateway accepts")

    def _line(self, raw: bytes) -> None:
        self.number += 1
        number = self.number
        if not _NOT_BLANK.search(raw):  # a blank line, as `Lines` skips it
            return
        self.count += 1
        if self.count > self.max_lines:
            raise bad_line(number, f"the file has more than the {self.max_lines} lines a batch may have",
                           "too_many_lines")
        if len(raw) > self.max_line_bytes:
            raise self._too_long(number)
        line = parse(number, raw)
        custom_id = line["custom_id"]
        if custom_id in self.seen:
            raise bad_line(number, f"custom_id {custom_id[:100]!r} is used by an earlier line", "duplicate_custom_id")
        self.seen.add(custom_id)
        url, model = self.url, self.model
        if url and line["url"] != url:
            raise bad_line(number, f"url {line['url']} differs from the first line's {url}: a batch has one endpoint",
                           "mismatched_url")
        line_model = line["body"]["model"]
        if model and line_model != model:
            raise bad_line(number, f"model {line_model[:100]!r} differs from the first line's {model!r}: a batch has "
                           "one model", "mismatched_model")
        if not model:
            refusal = self.model_refusal(line_model)
            if refusal:
                raise bad_line(number, refusal, "model_not_allowed")
        self.url, self.model = line["url"], line_model


def parse(number: int, raw: bytes) -> dict[str, Any]:
    """One line, checked: its custom_id, method, url and body."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg == "depth limit exceeded":  # orjson's own bound (1024 levels), well past ours
            raise bad_line(number, json_too_deep("it"), "json_too_deep") from None
        raise bad_line(number, f"not valid JSON ({exc.msg})", "invalid_json") from None
    if nests_past_bound(raw, line):
        raise bad_line(number, json_too_deep("it"), "json_too_deep")
    if not isinstance(line, dict):
        raise bad_line(number, "must be a JSON object", "invalid_json")
    for name in ("custom_id", "method", "url", "body"):
        if name not in line:
            raise bad_line(number, f"'{name}' is missing", "missing_field")
    custom_id = line["custom_id"]
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise bad_line(number, f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if line["method"] != "POST":
        raise bad_line(number, "'method' must be POST", "invalid_method")
    if line["url"] not in ENDPOINTS:
        raise bad_line(number, f"'url' must be one of {', '.join(ENDPOINTS)}", "invalid_url")
    body = line["body"]
    if not isinstance(body, dict):
        raise bad_line(number, "'body' must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_line(number, "'body.model' must name a model", "missing_field")
    if body.get("stream") not in (None, False):
        raise bad_line(number, "'body.stream' cannot be used in a batch")
    return line


class Lines(Sequence[dict[str, Any]]):
    """The lines of a file `read_lines` accepted (its non-blank ones, in order), each parsed when asked for: only
    where each begins and ends is kept (16 bytes a line), so a batch being run holds its file's bytes once, mapped
    from the volume (the kernel's page cache, not the heap), and no parsed line but those in flight; 100 MB of
    lines parsed up front would be several hundred MB of objects, for every batch a process runs."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.data = data
        self.spans = array("q")  # start, end of each non-blank line
        at, size = 0, len(data)
        while at < size:
            end = data.find(b"\n", at)
            end = size if end < 0 else end
            if _NOT_BLANK.search(data, at, end):  # (a line is not copied to be tested)
                self.spans.extend((at, end))
            at = end + 1

    def __len__(self) -> int:
        return len(self.spans) // 2

    @overload
    def __getitem__(self, n: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, n: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, n: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(n, slice):
            return [self[i] for i in range(*n.indices(len(self)))]
        if not -len(self) <= n < len(self):
            raise IndexError(n)
        n %= len(self)
        line: dict[str, Any] = orjson.loads(memoryview(self.data)[self.spans[2 * n]:self.spans[2 * n + 1]])
        return line  # a JSON object: the file is one read_lines accepted
