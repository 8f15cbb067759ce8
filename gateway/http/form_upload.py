"""A multipart/form-data upload (the audio routes) streamed through to a replica, never held whole.

The gateway needs one field of the form, `model`, to authenticate, limit and route the call, and must rename it
to the replica's served name; everything else (the audio file above all) goes on byte for byte. So the body is
read, through multipart's push parser (a dependency of the HTTP framework already), only until the `model`
field is whole; those bytes are held, and sent first with the model's value replaced; the rest is passed on
chunk by chunk as the client sends it, still through the parser, so a body that turns out malformed is cut off
(the replica never sees a whole request) and answered 400. Clients put the text fields before the file (the
openai SDK does), so what is held is a few hundred bytes; a form whose `model` comes after its file is held up
to the route's size limit, which the body source enforces (413).

The model's value is cut out of the held bytes by position: a part's value ends just before the delimiter
that closes it (CRLF `--boundary`), and no part's bytes can contain that delimiter, so the n-th part ends at
the (n+1)-th delimiter; the parser's own reading of the value is checked against the bytes found there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header

from policies.errors import BadRequest
from policies.pipeline import Slot

READ_FIELDS = ("model", "stream")  # the text fields the gateway reads (when they come before the model's end)
FIELD_LIMIT = 1024  # bytes of one of those fields' values the gateway reads


class FormUpload:
    def __init__(self, source: AsyncIterator[bytes], content_type: str) -> None:
        kind, options = parse_options_header(content_type or "")
        boundary = options.get("boundary", "")
        if kind != "multipart/form-data" or not 0 < len(boundary) <= 200:
            raise BadRequest("the request body must be multipart/form-data with a boundary",
                             code="invalid_content_type")
        self.boundary = boundary.encode("latin-1")
        self.source = source
        self.parser = PushMultipartParser(self.boundary, max_header_count=16)
        self.held: list[bytes] = []
        self.fields: dict[str, str] = {}
        self.parts = 0  # parts begun so far
        self.model_part = 0  # the model's part, counted from 1 (0: not seen yet)
        self.model_value = b""
        self.ended = False  # the source has no more bytes
        self.started = False
        self._current: MultipartSegment | None = None
        self._value: list[bytes] | None = None  # the value of a field being read

    async def read_head(self) -> dict[str, str]:
        """Read until the `model` field is whole (or the body ends); the text fields read so far."""
        while not self.model_part:
            chunk = await anext(self.source, None)
            if chunk is None:
                self._parse(b"")
                self.ended = True
                break
            self.held.append(chunk)
            self._parse(chunk)
        return dict(self.fields)

    def head(self, served: str | None) -> bytes:
        """The bytes read so far, the model's value replaced by `served`."""
        held = b"".join(self.held)
        if not self.model_part or served is None:
            return held
        end = self._delimiters(held)[self.model_part] - 2
        start = end - len(self.model_value)
        if start < 0 or held[start:end] != self.model_value:
            raise BadRequest("the multipart body's 'model' field could not be located", param="model",
                             code="invalid_multipart")
        return held[:start] + served.encode() + held[end:]

    async def upload(self, served: str | None) -> AsyncIterator[bytes]:
        """The whole body for the replica: the held head renamed, then the rest as it arrives. Runs once."""
        if self.started:
            raise RuntimeError("a streamed upload can be sent only once")
        self.started = True
        yield self.head(served)
        self.held = []
        if self.ended:
            return
        while (chunk := await anext(self.source, None)) is not None:
            self._parse(chunk)
            yield chunk
        self._parse(b"")

    def _delimiters(self, held: bytes) -> list[int]:
        marker = b"--" + self.boundary
        found, at = [], held.find(marker)
        while at >= 0:
            if at == 0 or held[at - 2:at] == b"\r\n":
                found.append(at)
            at = held.find(marker, at + len(marker))
        return found

    def _parse(self, chunk: bytes) -> None:
        try:
            for event in self.parser.parse(chunk):
                if isinstance(event, MultipartSegment):
                    self._begin(event)
                elif event is None:
                    self._end()
                elif self._value is not None:
                    self._value.append(event)
                    if sum(map(len, self._value)) > FIELD_LIMIT:
                        assert self._current is not None  # a value is read only inside a segment
                        raise BadRequest(f"the form field '{self._current.name}' is longer than {FIELD_LIMIT} bytes",
                                         param=self._current.name, code="invalid_multipart")
            if not chunk and not self.parser.closed:
                raise BadRequest("the multipart body ended early", code="invalid_multipart")
        except MultipartError as exc:
            raise BadRequest(f"the request body is not valid multipart/form-data: {str(exc)[:200]}",
                             code="invalid_multipart") from None

    def _begin(self, segment: MultipartSegment) -> None:
        self.parts += 1
        self._current = segment
        wanted = segment.filename is None and segment.name in READ_FIELDS and segment.name not in self.fields
        self._value = [] if wanted and not self.model_part else None

    def _end(self) -> None:
        segment, value, self._value = self._current, self._value, None
        if value is None:
            return
        assert segment is not None  # a value is read only inside a segment
        raw = b"".join(value)
        try:
            self.fields[segment.name] = raw.decode()
        except UnicodeDecodeError:
            raise BadRequest(f"the form field '{segment.name}' is not UTF-8", param=segment.name,
                             code="invalid_multipart") from None
        if segment.name == "model":
            self.model_part, self.model_value = self.parts, raw


UPLOAD: Slot[FormUpload] = Slot("upload")  # a multipart body streamed through, on the call that carries it
