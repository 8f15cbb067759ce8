"""The simulator's routes beyond chat, completions and embeddings, in vLLM 0.32's shapes (captured samples in
tests/fixtures/vllm-0.32-cpu): the Responses API (with an in-memory store, as vLLM's
VLLM_ENABLE_RESPONSES_API_STORE=1, and the events of a `background` streamed response, streamed again by
GET /v1/responses/{id}?stream=true[&starting_after=N]), Anthropic's Messages API, /tokenize and /detokenize,
and the pooling routes (rerank, score, pooling) with deterministic scores. Generation goes through the same engine
as chat, so these routes load the simulated backend (and its metrics) the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol
from urllib.parse import parse_qs

import orjson

from .config import SimConfig
from .engine import Engine, GenRequest
from .exchange import Http
from .protocol import ApiError, check_lengths, tokenize
from .vocab import detokenize, token_id

STORED = 1000  # responses kept for retrieval, oldest dropped first


class Host(Protocol):
    """What these routes use of the simulator's app (tools/simulator/app.py)."""

    cfg: SimConfig
    engine: Engine

    def _check_model(self, model: str | None) -> None: ...

    def _embed(self, tokens: Sequence[str | int]) -> list[float]: ...


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text(v.get("content", v.get("text")) if isinstance(v, dict) else v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("text", value.get("content")))
    return str(value)


class Events:
    """The events of a response made with `background` and `stream`, kept to be streamed again."""

    def __init__(self, pending: dict[str, Any]) -> None:
        self.pending = pending  # what a plain retrieve answers until it is done
        self.frames: list[bytes] = []
        self.more = asyncio.Event()
        self.done = False


BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _retrieve_query(raw: bytes) -> tuple[bool, int | None]:
    """`stream` and `starting_after` as vLLM's retrieve reads them (FastAPI's parsing, its 400s)."""
    query = parse_qs(raw.decode("latin-1"))
    stream = BOOLS.get(query.get("stream", ["false"])[-1].lower())
    if stream is None:
        raise ApiError(400, "1 validation error: query.stream: Input should be a valid boolean", param="query.stream")
    given = query.get("starting_after")
    if given is None:
        return stream, None
    try:
        return stream, int(given[-1])
    except ValueError:
        raise ApiError(400, "1 validation error: query.starting_after: Input should be a valid integer",
                       param="query.starting_after") from None


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value: object = body.get(name, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ApiError(400, f"{name} must be a positive integer", param=name)
    return value


class Extras:
    def __init__(self, app: Host) -> None:
        self.app = app
        self.stored: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.events: OrderedDict[str, Events] = OrderedDict()  # of background streamed responses
        self.background: set[asyncio.Task[None]] = set()
        self.routes = {
            "/v1/responses": self.responses, "/v1/messages": self.messages,
            "/v1/messages/count_tokens": self.count_tokens, "/tokenize": self.tokenize,
            "/detokenize": self.detokenize, "/reset_prefix_cache": self.reset_prefix_cache, "/rerank": self.rerank,
            "/v1/rerank": self.rerank,
            "/v2/rerank": self.rerank, "/score": self.score, "/v1/score": self.score, "/pooling": self.pooling,
        }  # no /classify: like a vLLM pooling model converted for embedding, it answers 404

    async def body(self, http: Http) -> dict[str, Any]:
        body: object = await http.read_json()
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        self.app._check_model(body.get("model"))
        return body

    def submit(self, text: str, max_tokens: int | None, body: dict[str, Any]) -> GenRequest:
        prompt = tokenize(text) or [""]
        check_lengths(len(prompt), max_tokens, self.app.cfg.max_model_len)
        if max_tokens is None:
            max_tokens = min(self.app.cfg.default_max_tokens, self.app.cfg.max_model_len - len(prompt))
        return self.app.engine.submit(prompt, max_tokens, ignore_eos=body.get("ignore_eos") is True)

    # ---- Responses ---------------------------------------------------------------------------------------

    async def responses(self, http: Http) -> None:
        body = await self.body(http)
        previous = body.get("previous_response_id")
        history = ""
        if previous is not None:
            earlier = self.stored.get(previous)
            if earlier is None:
                raise ApiError(404, f"Response with id '{previous}' not found.", "NotFoundError",
                               "previous_response_id")
            history = earlier["_text"]
        max_tokens = _int(body, "max_output_tokens", None)
        gen = self.submit(history + _text(body.get("instructions")) + _text(body.get("input")), max_tokens, body)
        request_id = body.get("request_id")
        response_id = request_id if isinstance(request_id, str) else f"resp_{secrets.token_hex(8)}"
        background = body.get("background") is True
        shape = {"id": response_id, "created_at": int(time.time()), "object": "response",
                 "model": self.app.cfg.model, "max_output_tokens": max_tokens, "previous_response_id": previous,
                 "instructions": body.get("instructions"), "tools": [], "tool_choice": "none",
                 "temperature": body.get("temperature", 1.0), "background": background,
                 "metadata": body.get("metadata")}
        if background and body.get("stream") is True:  # as vLLM: made on its own, its events kept to stream again
            events = self.events[response_id] = Events({**shape, "status": "queued", "output": [], "usage": None})
            while len(self.events) > STORED:
                self.events.popitem(last=False)
            task = asyncio.create_task(self._keep_events(gen, shape, body, events))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            await self._replay(http, events, 0)
            return
        async with http.abort_on_disconnect(gen):
            if body.get("stream") is True:
                await http.start(200, b"text/event-stream; charset=utf-8")
                async for frames in self._frames(gen, shape, body):
                    await http.write(b"".join(frames))
                await http.write(b"", more=False)
                return
            await gen.wait()
            if gen.finish_reason in ("stop", "length"):
                await http.json(200, self._keep(self._response(gen, shape), body))

    def _response(self, gen: GenRequest, shape: dict[str, Any]) -> dict[str, Any]:
        done = gen.finish_reason == "stop"
        return {**shape, "status": "completed" if done else "incomplete",
                "incomplete_details": None if done else {"reason": "max_output_tokens"},
                "output": [{"id": f"msg_{secrets.token_hex(8)}", "type": "message", "role": "assistant",
                            "status": "completed", "content": [{"type": "output_text", "text": gen.text,
                                                                 "annotations": [], "logprobs": None}]}],
                "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": gen.output_tokens,
                          "total_tokens": gen.prompt_tokens + gen.output_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    def _keep(self, response: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        if body.get("store", True) is not False:
            self.stored[response["id"]] = {**response, "_text": _text(body.get("input")) + response["output"][0]
                                           ["content"][0]["text"]}
            while len(self.stored) > STORED:
                self.stored.popitem(last=False)
        return response

    async def _frames(self, gen: GenRequest, shape: dict[str, Any], body: dict[str, Any],
                      fail_after: int | None = None) -> AsyncIterator[list[bytes]]:
        """A response's stream as vLLM frames it, in batches as generated (none after an abort). `fail_after`:
        the engine fails once that many text events are out, and the stream ends in vLLM's `error` frame."""
        seq = 0
        deltas = 0

        def frame(kind: str, data: dict[str, Any]) -> bytes:
            nonlocal seq
            seq += 1
            return _event(kind, {**data, "sequence_number": seq - 1, "type": kind})

        pending = {**shape, "status": "in_progress", "output": [], "usage": None}
        item = f"msg_{secrets.token_hex(8)}"
        yield [frame("response.created", {"response": pending}), frame("response.in_progress", {"response": pending}),
               frame("response.output_item.added", {"output_index": 0, "item": {
                   "id": item, "type": "message", "role": "assistant", "status": "in_progress", "content": []}})]
        async for batch in gen.batches():
            if fail_after is not None and deltas + len(batch) > fail_after:
                batch = batch[:fail_after - deltas]
                gen.abort()
            deltas += len(batch)
            yield [frame("response.output_text.delta", {"item_id": item, "output_index": 0, "content_index": 0,
                                                         "delta": piece, "logprobs": []}) for piece in batch]
            if fail_after is not None and deltas >= fail_after:
                gen.abort()
                yield [frame("error", {"code": "InternalServerError", "param": None,
                                       "message": "The simulated engine failed (fail_background_after)."})]
                return
        if gen.finish_reason not in ("stop", "length"):
            return
        final = self._keep(self._response(gen, shape), body)
        yield [frame("response.output_text.done", {"item_id": item, "output_index": 0, "content_index": 0,
                                                    "text": gen.text}),
               frame("response.completed", {"response": final})]

    async def _keep_events(self, gen: GenRequest, shape: dict[str, Any], body: dict[str, Any],
                           events: Events) -> None:
        try:
            async for frames in self._frames(gen, shape, body, self.app.cfg.fail_background_after):
                events.frames += frames
                events.more.set()
        finally:
            events.done = True
            events.more.set()

    async def _replay(self, http: Http, events: Events, start: int) -> None:
        """A background response's events from `start` on, as they come, until `response.completed` (vLLM's
        event store): the stream of one that ended otherwise (failed) stays open until the client leaves."""
        await http.start(200, b"text/event-stream; charset=utf-8")
        while True:
            events.more.clear()
            done, end = events.done, len(events.frames)  # as of now: more may come while the write waits
            if start < end:
                await http.write(b"".join(events.frames[start:end]))
                start = end
            if done:
                break
            await events.more.wait()
        if events.frames and events.frames[-1].startswith(b"event: response.completed\n"):
            await http.write(b"", more=False)
            return
        while (await http.receive())["type"] != "http.disconnect":
            pass

    async def retrieve(self, http: Http, response_id: str) -> None:
        stream, starting_after = _retrieve_query(http.query)
        stored = self.stored.get(response_id)
        events = self.events.get(response_id)
        if stored is None and events is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", "NotFoundError", "response_id")
        if not stream:
            if stored:
                await http.json(200, {k: v for k, v in stored.items() if k != "_text"})
            else:
                assert events is not None  # one of the two is (above)
                await http.json(200, events.pending)
            return
        if events is None:  # vLLM has no events of a response not made in the background: its stream breaks off
            await http.start(200, b"text/event-stream; charset=utf-8")
            raise RuntimeError(f"Unknown response_id: {response_id}")
        await self._replay(http, events, 0 if starting_after is None else starting_after + 1)

    async def cancel(self, http: Http, response_id: str) -> None:
        stored = self.stored.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", "NotFoundError", "response_id")
        raise ApiError(400, "Cannot cancel a synchronous response.", param="response_id")

    # ---- Anthropic Messages ------------------------------------------------------------------------------

    def _messages_prompt(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: Field required", param="messages")
        return _text(body.get("system")) + _text(messages)

    async def messages(self, http: Http) -> None:
        body = await self.body(http)
        gen = self.submit(self._messages_prompt(body), _int(body, "max_tokens", None), body)
        message_id = f"chatcmpl-{secrets.token_hex(8)}"
        reason = {"stop": "end_turn", "length": "max_tokens"}
        async with http.abort_on_disconnect(gen):
            if body.get("stream") is True:
                await http.start(200, b"text/event-stream; charset=utf-8")
                await http.write(_event("message_start", {"type": "message_start", "message": {
                    "id": message_id, "type": "message", "role": "assistant", "content": [],
                    "model": self.app.cfg.model, "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}}) +
                    _event("content_block_start", {"type": "content_block_start",
                                                   "content_block": {"type": "text", "text": ""}, "index": 0}))
                async for batch in gen.batches():
                    await http.write(b"".join(_event("content_block_delta", {
                        "type": "content_block_delta", "delta": {"type": "text_delta", "text": piece}, "index": 0})
                        for piece in batch))
                if gen.finish_reason not in reason:
                    await http.write(b"", more=False)
                    return
                await http.write(_event("content_block_stop", {"type": "content_block_stop", "index": 0}) +
                                 _event("message_delta", {"type": "message_delta", "delta": {
                                     "stop_reason": reason[gen.finish_reason], "stop_sequence": None},
                                     "usage": {"input_tokens": gen.prompt_tokens,
                                               "output_tokens": gen.output_tokens}}) +
                                 _event("message_stop", {"type": "message_stop"}), more=False)
                return
            await gen.wait()
            if gen.finish_reason in reason:
                await http.json(200, {"id": message_id, "type": "message", "role": "assistant",
                                      "content": [{"type": "text", "text": gen.text}], "model": self.app.cfg.model,
                                      "stop_reason": reason[gen.finish_reason],
                                      "usage": {"input_tokens": gen.prompt_tokens,
                                                "output_tokens": gen.output_tokens}})

    async def count_tokens(self, http: Http) -> None:
        body = await self.body(http)
        count = len(tokenize(self._messages_prompt(body)))
        await http.json(200, {"input_tokens": count, "context_management": {"original_input_tokens": count}})

    async def reset_prefix_cache(self, http: Http) -> None:
        """vLLM serves POST /reset_prefix_cache with VLLM_SERVER_DEV_MODE=1: benchmarks empty the cache with it."""
        self.app.engine._prefix.clear()
        await http.json(200, {})

    # ---- tokenizer ---------------------------------------------------------------------------------------

    async def tokenize(self, http: Http) -> None:
        body = await self.body(http)
        text = body.get("prompt") if "prompt" in body else _text(body.get("messages"))
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        tokens = [token_id(piece) for piece in tokenize(text)]  # the same ids in every process (vocab.py)
        await http.json(200, {"count": len(tokens), "max_model_len": self.app.cfg.max_model_len, "tokens": tokens,
                              "token_strs": None})

    async def detokenize(self, http: Http) -> None:
        body = await self.body(http)
        tokens = body.get("tokens")
        text = detokenize(tokens) if isinstance(tokens, list) else None
        if text is None:
            raise ApiError(400, "tokens must be ids this tokenizer made", param="tokens")
        await http.json(200, {"prompt": text})

    # ---- pooling -----------------------------------------------------------------------------------------

    def _score(self, a: str, b: str) -> float:
        digest = hashlib.sha256(f"{self.app.cfg.seed}|{a}|{b}".encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32

    def _usage(self, *texts: str) -> dict[str, Any]:
        used = sum(len(tokenize(t)) for t in texts)
        return {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0, "prompt_tokens_details": None}

    async def rerank(self, http: Http) -> None:
        body = await self.body(http)
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            raise ApiError(400, "query (a string) and documents (a list) are required", param="documents")
        texts = [_text(d) for d in documents]
        scored = sorted(((self._score(query, t), i, t) for i, t in enumerate(texts)), key=lambda r: -r[0])
        results = [{"index": i, "document": {"text": t, "multi_modal": None}, "relevance_score": score}
                   for score, i, t in scored]
        top = body.get("top_n")
        await http.json(200, {"id": f"rerank-{secrets.token_hex(8)}", "model": self.app.cfg.model,
                              "usage": {"prompt_tokens": self._usage(query, *texts)["prompt_tokens"],
                                        "total_tokens": self._usage(query, *texts)["total_tokens"]},
                              "results": results[:top] if isinstance(top, int) and top > 0 else results})

    async def score(self, http: Http) -> None:
        body = await self.body(http)
        first, second = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        if first is None or second is None:
            raise ApiError(400, "text_1 and text_2 are required", param="text_2")
        seconds = second if isinstance(second, list) else [second]
        firsts = first if isinstance(first, list) else [first] * len(seconds)
        data = [{"index": i, "object": "score", "score": self._score(_text(a), _text(b))}
                for i, (a, b) in enumerate(zip(firsts, seconds, strict=False))]
        await http.json(200, {"id": f"score-{secrets.token_hex(8)}", "object": "list",
                              "created": int(time.time()), "model": self.app.cfg.model, "data": data,
                              "usage": self._usage(*map(_text, firsts), *map(_text, seconds))})

    async def pooling(self, http: Http) -> None:
        body = await self.body(http)
        inputs = body.get("input")
        items = inputs if isinstance(inputs, list) else [inputs]
        data = [{"index": i, "object": "pooling", "data": self.app._embed(tokenize(_text(x)) or [""])}
                for i, x in enumerate(items)]
        await http.json(200, {"id": f"pool-{secrets.token_hex(8)}", "object": "list", "created": int(time.time()),
                              "model": self.app.cfg.model, "data": data, "usage": self._usage(*map(_text, items))})
