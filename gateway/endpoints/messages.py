"""Anthropic's Messages API as vLLM serves it: POST /v1/messages (streamed as `event:` frames: the prompt's
tokens in `message_start`, the output's in `message_delta`) and /v1/messages/count_tokens. Anthropic's SDK
sends its key as `x-api-key`, so that header is accepted as the key here (sent with an `Authorization: Bearer`
that holds another key, neither is trusted: a 401), and every error on these routes
has Anthropic's shape ({"type": "error", "error": {"type", "message"}}) so that SDK raises the right class."""

from __future__ import annotations



from gateway.endpoints.base import Route, io_usage, no_usage
from gateway.http.error_shapes import anthropic_error
from gateway.relay import EventRelay
from policies.json_types import JSONObject
from policies.pipeline import Call
from policies.routing.prompt import messages_text
from policies.tokens import Estimate, chat_prompt, max_output

def start_usage(frame: JSONObject) -> dict[str, int] | None:
    message = frame.get("message")
    return io_usage(message.get("usage")) if isinstance(message, dict) else None


def delta_usage(frame: JSONObject) -> dict[str, int] | None:
    return io_usage(frame.get("usage"))


def relay(_call: Call, rename: tuple[bytes, bytes] | None) -> EventRelay:
    return EventRelay({b"message_start": start_usage, b"message_delta": delta_usage}, rename)


def usage(data: JSONObject) -> dict[str, int] | None:
    return io_usage(data.get("usage"))


MESSAGES = Route("messages", "/v1/messages", tokens=Estimate(chat_prompt, max_output("max_tokens")), usage=usage,
                 relay=relay, errors=anthropic_error, key_header="x-api-key", prompt=messages_text)
COUNT_TOKENS = Route("messages/count_tokens", "/v1/messages/count_tokens", usage=no_usage, errors=anthropic_error,
                     key_header="x-api-key")
