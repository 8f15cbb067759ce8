"""The simulator's speech-to-text routes, POST /v1/audio/transcriptions and /v1/audio/translations, in vLLM
0.32's shapes (vllm/entrypoints/speech_to_text): a multipart form with `file` and `model`; the answer
{"text", "usage": {"type": "duration", "seconds"}} (translations: {"text"}), or with `stream=true` SSE
`transcription.chunk` / `translation.chunk` deltas, a usage chunk when `stream_include_usage=true`, and
`[DONE]`. The audio is not decoded: its length in bytes stands for its duration (16 kHz, 16-bit mono), and
the text comes from the generation engine like chat's, so these routes load the simulated backend too.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import Any, Protocol

import orjson
from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header

from .config import SimConfig
from .engine import GenRequest
from .exchange import Http
from .extras import Extras
from .protocol import ApiError

BYTES_PER_SECOND = 32000
TOKENS_PER_SECOND = 25  # the prompt tokens an audio second stands for
FORMATS = ("json", "text", "verbose_json")


async def read_form(http: Http) -> tuple[dict[str, str], bytes | None]:
    """The form's text fields and its file's bytes (vLLM reads the whole form before it starts)."""
    kind, options = parse_options_header(http.headers.get(b"content-type", b"").decode("latin-1"))
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise ApiError(400, "There was an error parsing the body")
    fields: dict[str, str] = {}
    audio: bytes | None = None
    current: MultipartSegment | None = None
    parts: list[bytes] = []
    try:
        with PushMultipartParser(options["boundary"]) as parser:
            async for chunk in http.chunks():
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        current, parts = event, []
                    elif event is None:  # the end of the segment that began with `current`
                        assert current is not None
                        if current.filename is not None:
                            audio = b"".join(parts)
                        else:
                            fields[current.name] = b"".join(parts).decode()
                    else:
                        parts.append(event)
    except (MultipartError, UnicodeDecodeError):
        raise ApiError(400, "There was an error parsing the body") from None
    return fields, audio


def _flag(fields: dict[str, str], name: str) -> bool:
    return fields.get(name, "false").lower() in ("true", "1")


class Host(Protocol):
    """What these routes use of the simulator's app (tools/simulator/app.py)."""

    cfg: SimConfig
    extras: Extras

    def _check_model(self, model: str | None) -> None: ...


class Audio:
    def __init__(self, app: Host) -> None:
        self.app = app
        self.routes = {"/v1/audio/transcriptions": self.transcriptions, "/v1/audio/translations": self.translations}

    async def transcriptions(self, http: Http) -> None:
        await self.serve(http, "transcribe", "transcription", "trsc")

    async def translations(self, http: Http) -> None:
        await self.serve(http, "translate", "translation", "trsl")

    async def serve(self, http: Http, task: str, kind: str, prefix: str) -> None:
        fields, audio = await read_form(http)
        if audio is None:
            raise ApiError(422, "Field required: file", "Bad Request", "file")
        self.app._check_model(fields.get("model"))
        response_format = fields.get("response_format", "json")
        if response_format not in FORMATS:
            raise ApiError(400, "Currently only support response_format: `text`, `json`, `verbose_json` or "
                                "`diarized_json`")
        stream, usage = _flag(fields, "stream"), _flag(fields, "stream_include_usage")
        if usage and not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_include_usage")
        seconds = len(audio) / BYTES_PER_SECOND
        gen = self.app.extras.submit("audio " * max(1, math.ceil(seconds * TOKENS_PER_SECOND)), None, {})
        async with http.abort_on_disconnect(gen):
            if stream:
                await self._stream(http, gen, kind, prefix, usage)
                return
            await gen.wait()
            if gen.finish_reason not in ("stop", "length"):
                return
            answer: dict[str, Any]
            if response_format == "verbose_json":
                answer = {"text": gen.text, "language": fields.get("language"), "duration": seconds, "segments": []}
            elif task == "transcribe":
                answer = {"text": gen.text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}}
            else:
                answer = {"text": gen.text}
            await http.json(200, answer)

    async def _stream(self, http: Http, gen: GenRequest, kind: str, prefix: str, usage: bool) -> None:
        shape = {"id": f"{prefix}-{secrets.token_hex(16)}", "object": f"{kind}.chunk", "created": int(time.time()),
                 "model": self.app.cfg.model}
        await http.start(200, b"text/event-stream; charset=utf-8")
        async for batch in gen.batches():
            await http.write(b"".join(b"data: " + orjson.dumps({**shape, "choices": [
                {"delta": {"content": piece}}]}) + b"\n\n" for piece in batch))
        if gen.finish_reason not in ("stop", "length"):
            await http.write(b"", more=False)
            return
        tail = b""
        if usage:
            tail = b"data: " + orjson.dumps({**shape, "choices": [], "usage": {
                "prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.output_tokens,
                "total_tokens": gen.prompt_tokens + gen.output_tokens}}) + b"\n\n"
        await http.write(tail + b"data: [DONE]\n\n", more=False)
