"""The simulator's HTTP face: a plain ASGI app with vLLM 0.32's routes, response shapes and errors.

Plain ASGI rather than a framework keeps the two things that matter here explicit: lifespan starts and stops
the engine loop, and every generation request watches `receive` for http.disconnect, so a client that goes
away aborts its request in the engine at once, whether it is streaming or still waiting in the queue.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import random
import secrets
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .audio import Audio
from .config import SimConfig
from .engine import Engine, GenRequest
from .exchange import ClientGone, Http, Receive, Scope, Send
from .extras import Extras
from .lora import Lora
from .structured import Corruptor, Structured, structured_answer
from .protocol import (ApiError, ChatRequest, CompletionRequest, EmbeddingRequest, check_lengths,
                       completion_prompt, embedding_inputs, parse, refuse_unsupported, render_chat, tokenize)

VERSION = "0.32.0+sim"  # vLLM's version format, marked as the simulator's own
SSE = b"text/event-stream; charset=utf-8"
ENGINE_ERROR = ApiError(500, "The simulated engine failed; see the simulator's log.", "InternalServerError")


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SimulatorApp:
    """ASGI callable serving one simulated model."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.corruptor = Corruptor(cfg.corrupt_fraction)
        self.engine = Engine(cfg)
        self.registry = self.engine.metrics.registry
        self.created = int(time.time())
        self.bearer = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None
        self.fingerprint = f"vllm-{VERSION}-{hashlib.sha256(cfg.model.encode()).hexdigest()[:8]}"
        self.routes: dict[str, tuple[str, Callable[[Http], Awaitable[None]]]] = {
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/completions": ("POST", self.completions),
            "/v1/embeddings": ("POST", self.embeddings),
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health),
            "/version": ("GET", self.version),
            "/metrics": ("GET", self.metrics),
        }
        self.extras = Extras(self)
        self.audio = Audio(self)
        self.routes.update({path: ("POST", handler) for path, handler in {**self.extras.routes,
                                                                          **self.audio.routes}.items()})
        self.lora = Lora(self)
        if cfg.enable_lora:
            self.routes.update({path: ("POST", handler) for path, handler in self.lora.routes.items()})
            self.routes["/lora_stats"] = ("GET", self.lora.stats)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        http = Http(scope, receive, send)
        route = self.routes.get(http.path) or self._response_route(http.path)
        if self.bearer is not None and http.path.startswith("/v1") and not hmac.compare_digest(
                http.headers.get(b"authorization", b""), self.bearer):
            await http.json(401, {"error": "Unauthorized"})  # vLLM's own answer to a missing or wrong key
        elif route is None:
            await http.json(404, {"detail": "Not Found"})
        elif route[0] != http.method:
            await http.json(405, {"detail": "Method Not Allowed"})
        else:
            try:
                await route[1](http)
            except ApiError as exc:
                await http.json(exc.status, exc.body())
            except ClientGone:
                pass

    def _response_route(self, path: str) -> tuple[str, Callable[[Http], Awaitable[None]]] | None:
        """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel."""
        rest = path.removeprefix("/v1/responses/")
        if rest == path or not rest:
            return None
        if rest.endswith("/cancel"):
            return "POST", lambda http: self.extras.cancel(http, rest.removesuffix("/cancel"))
        return "GET", lambda http: self.extras.retrieve(http, rest)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.engine.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.cfg.model and not self.lora.holds(model):
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {self.cfg.model}.",
                           "NotFoundError", "model")

    # ---- generation -------------------------------------------------------------------------------------

    async def chat(self, http: Http) -> None:
        req = parse(ChatRequest, await http.read_json())
        self._check_model(req.model)
        refuse_unsupported(req, self.cfg.tool_calling)
        prompt = tokenize(render_chat(req))
        max_tokens = req.requested_max_tokens
        check_lengths(len(prompt), max_tokens, self.cfg.max_model_len)
        if max_tokens is None:
            max_tokens = min(self.cfg.default_max_tokens, self.cfg.max_model_len - len(prompt))
        await self._generate(http, req, prompt, max_tokens, chat=True)

    async def completions(self, http: Http) -> None:
        req = parse(CompletionRequest, await http.read_json())
        self._check_model(req.model)
        refuse_unsupported(req)
        prompt = completion_prompt(req)
        check_lengths(len(prompt), req.requested_max_tokens, self.cfg.max_model_len)
        await self._generate(http, req, prompt, req.requested_max_tokens, chat=False)

    async def _generate(self, http: Http, req: ChatRequest | CompletionRequest, prompt: Sequence[str | int],
                        max_tokens: int, chat: bool) -> None:
        gen = self.engine.submit(prompt, max_tokens, ignore_eos=req.ignore_eos, stop=req.stop_list, seed=req.seed)
        shape: _ChatShape | _CompletionShape = _ChatShape(
            self, structured_answer(req, self.cfg.tool_calling, self.corruptor)) if chat else _CompletionShape(self)
        shape.model = req.model if req.model and self.lora.holds(req.model) else self.cfg.model
        async with http.abort_on_disconnect(gen):
            if req.stream:
                await self._stream(http, gen, shape, req.include_usage)
                return
            await gen.wait()
            if gen.finish_reason == "error":
                await http.json(500, ENGINE_ERROR.body())
            elif gen.finish_reason != "abort":  # aborted: the client is gone or the server is stopping
                await http.json(200, shape.response(gen))

    async def _stream(self, http: Http, gen: GenRequest, shape: _ChatShape | _CompletionShape,
                      include_usage: bool) -> None:
        await http.start(200, SSE)
        first = True
        async for batch in gen.batches():
            out = [shape.first_chunk()] if first else []  # chat: the role chunk; completions: nothing
            first = False
            for i, piece in enumerate(batch):
                final = gen.finish_reason in ("stop", "length") and i == len(batch) - 1
                out.append(shape.chunk(piece, gen if final else None))
            await http.write(b"".join(out))
        if gen.finish_reason == "abort":
            await http.write(b"", more=False)
            return
        if gen.finish_reason == "error":
            await http.write(_sse(ENGINE_ERROR.body()) + b"data: [DONE]\n\n", more=False)
            return
        tail = [shape.usage_chunk(gen)] if include_usage else []
        await http.write(b"".join([*tail, b"data: [DONE]\n\n"]), more=False)

    # ---- other routes ------------------------------------------------------------------------------------

    async def embeddings(self, http: Http) -> None:
        """Deterministic unit vectors; answered at once, outside the generation engine and its metrics."""
        req = parse(EmbeddingRequest, await http.read_json())
        self._check_model(req.model)
        if req.dimensions is not None and req.dimensions != self.cfg.embedding_dim:
            raise ApiError(400, "Model does not support matryoshka representation, changing output dimensions "
                                "will lead to poor results.", param="dimensions")
        if req.encoding_format not in ("float", "base64"):
            raise ApiError(400, f"Unsupported encoding_format {req.encoding_format!r}.", param="encoding_format")
        inputs = embedding_inputs(req)
        for tokens in inputs:
            if len(tokens) > self.cfg.max_model_len:
                raise ApiError(400, f"This model's maximum context length is {self.cfg.max_model_len} tokens. "
                                    f"However, you requested {len(tokens)} tokens in the input for embedding "
                                    f"generation. Please reduce the length of the input.", param="input")
        data = []
        for i, tokens in enumerate(inputs):
            vector = self._embed(tokens)
            embedding: list[float] | str = vector
            if req.encoding_format == "base64":
                embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": i, "object": "embedding", "embedding": embedding})
        used = sum(len(t) for t in inputs)
        await http.json(200, {
            "id": f"embd-{secrets.token_hex(8)}", "object": "list", "created": int(time.time()),
            "model": self.cfg.model, "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0,
                      "prompt_tokens_details": None},
        })

    def _embed(self, tokens: Sequence[str | int]) -> list[float]:
        digest = hashlib.sha256(f"{self.cfg.seed}|{tokens!r}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        vector = [rng.gauss(0.0, 1.0) for _ in range(self.cfg.embedding_dim)]
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        return [x / norm for x in vector]

    async def models(self, http: Http) -> None:
        await http.json(200, {"object": "list", "data": [{
            "id": self.cfg.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.max_model_len,
            "permission": [{
                "id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": self.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }, *self.lora.model_entries(self.created)]})

    async def health(self, http: Http) -> None:
        await http.reply(200, b"", content_type=None)  # vLLM: 200, empty body, no content-type

    async def version(self, http: Http) -> None:
        await http.json(200, {"version": VERSION})

    async def metrics(self, http: Http) -> None:
        await http.reply(200, generate_latest(self.registry), CONTENT_TYPE_LATEST.encode())


# ---- response shapes (as captured from vLLM 0.32) --------------------------------------------------------

def _usage(gen: GenRequest, details: bool) -> dict[str, int | None]:
    usage: dict[str, int | None] = {
        "prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + gen.output_tokens,
        "completion_tokens": gen.output_tokens}
    if details:
        usage.update(prompt_tokens_details=None, completion_tokens_details=None)
    return usage


class _Shape:
    object_: str
    prefix: str

    def __init__(self, app: SimulatorApp):
        self.app = app
        self.id = f"{self.prefix}-{secrets.token_hex(8)}"
        self.model = app.cfg.model  # or the LoRA adapter the request named
        self.created = int(time.time())

    def head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def usage_chunk(self, gen: GenRequest) -> bytes:
        return _sse({**self.head(self.object_), "choices": [], "usage": _usage(gen, details=False),
                     "system_fingerprint": self.app.fingerprint})


class _ChatShape(_Shape):
    object_, prefix = "chat.completion.chunk", "chatcmpl"

    def __init__(self, app: SimulatorApp, structured: Structured | None = None):
        super().__init__(app)
        self.structured = structured
        self.left = structured.text if structured else ""  # what the stream has still to send of it
        self.named = False  # a streamed tool call names its function in its first delta

    def first_chunk(self) -> bytes:
        return _sse({**self.head(self.object_), "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": None, "prompt_text": None})

    def chunk(self, piece: str, final: GenRequest | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None,
                        "finish_reason": final.finish_reason if final else None}
        if self.structured is not None:  # the engine's timing, the structured answer's text (8 characters a token)
            part, self.left = (self.left, "") if final else (self.left[:8], self.left[8:])
            choice["delta"] = self.structured_delta(part)
            if final and self.structured.tool:
                choice["finish_reason"] = "tool_calls"
        if final:
            choice["stop_reason"] = final.stop_reason
        choice["token_ids"] = None
        return _sse({**self.head(self.object_), "choices": [choice]})

    def structured_delta(self, part: str) -> dict[str, Any]:
        s = self.structured
        assert s is not None  # called only for a structured answer (see chunk)
        if s.tool is None:
            return {"content": part}
        first, self.named = not self.named, True
        function = {"name": s.tool, "arguments": part} if first else {"arguments": part}
        return {"tool_calls": [{"index": 0, **({"id": s.call_id, "type": "function"} if first else {}),
                                "function": function}]}

    def response(self, gen: GenRequest) -> dict[str, Any]:
        s = self.structured
        content = gen.text if s is None else (s.text if s.tool is None else None)
        calls = {"tool_calls": [{"id": s.call_id, "type": "function", "function": {
            "name": s.tool, "arguments": s.text}}]} if s is not None and s.tool else {}
        return {**self.head("chat.completion"), "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                        "audio": None, "function_call": None, "reasoning": None, **calls},
            "logprobs": None, "finish_reason": "tool_calls" if calls else gen.finish_reason,
            "stop_reason": gen.stop_reason,
            "token_ids": None, "routed_experts": None,
        }], "service_tier": None, "system_fingerprint": self.app.fingerprint, "usage": _usage(gen, details=True),
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


class _CompletionShape(_Shape):
    object_, prefix = "text_completion", "cmpl"

    def first_chunk(self) -> bytes:
        return b""

    def chunk(self, piece: str, final: GenRequest | None) -> bytes:
        return _sse({**self.head(self.object_), "choices": [{
            "index": 0, "text": piece, "logprobs": None, "finish_reason": final.finish_reason if final else None,
            "stop_reason": final.stop_reason if final else None, "prompt_token_ids": None, "token_ids": None}]})

    def response(self, gen: GenRequest) -> dict[str, Any]:
        return {**self.head("text_completion"), "choices": [{
            "index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason,
            "stop_reason": gen.stop_reason, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            "routed_experts": None,
        }], "service_tier": None, "system_fingerprint": self.app.fingerprint, "usage": _usage(gen, details=True),
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def create_app(cfg: SimConfig | None = None) -> SimulatorApp:
    """An ASGI app (with lifespan) that serves one simulated vLLM model."""
    return SimulatorApp(cfg or SimConfig())
