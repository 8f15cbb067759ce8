"""A scriptable OpenAI-compatible upstream that records every request it receives.

For contract tests of the gateway's proxying (what is forwarded, how upstream failures surface). It is not a
vLLM stand-in: tests of behaviour against vLLM use the simulator or, end to end, a real vLLM.
"""

from __future__ import annotations

import asyncio

import orjson

from tests.support.asgi import lifespan, read_body


class Recorder:
    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        self.mode = "ok"  # ok | status:<code> | break | slow:<seconds>
        self.health = 200

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["path"] == "/health":
            await self._send(send, self.health, b"")
            return
        if scope["path"] == "/metrics":  # the gateway's load scrape: a recorder has no vLLM metrics to give
            await self._send(send, 404, b"")
            return
        raw = await read_body(receive)
        body = orjson.loads(raw)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append({"path": scope["path"], "headers": headers, "body": body})
        if self.mode.startswith("status:"):
            status = int(self.mode.split(":")[1])
            error = {"message": f"scripted failure {status}", "type": "BadRequestError", "param": None, "code": status}
            await self._send(send, status, orjson.dumps({"error": error}))
            return
        if self.mode.startswith("slow:"):
            await asyncio.sleep(float(self.mode.split(":")[1]))
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        if not body.get("stream"):
            reply = {"id": "x", "object": "chat.completion", "model": body.get("model"), "served_by": self.name,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"},
                                  "finish_reason": "stop"}], "usage": usage}
            await self._send(send, 200, orjson.dumps(reply))
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        model = orjson.dumps(body.get("model"))
        for i, piece in enumerate(["", "a", "b", "c"]):
            delta = {"role": "assistant", "content": ""} if i == 0 else {"content": piece}
            chunk = b'{"id":"x","object":"chat.completion.chunk","model":' + model + b',"choices":' + orjson.dumps(
                [{"index": 0, "delta": delta, "finish_reason": "stop" if i == 3 else None}]) + b"}"
            await send({"type": "http.response.body", "body": b"data: " + chunk + b"\n\n", "more_body": True})
            if self.mode == "break" and i == 1:
                raise RuntimeError("scripted mid-stream failure")  # the server drops the connection
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = b'{"id":"x","object":"chat.completion.chunk","model":' + model + b',"choices":[],"usage":'
            await send({"type": "http.response.body", "body": b"data: " + chunk + orjson.dumps(usage) + b"}\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    @staticmethod
    async def _send(send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
