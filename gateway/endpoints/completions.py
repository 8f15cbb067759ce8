"""POST /v1/completions: text completion, streamed like chat or not."""

from gateway.endpoints.base import Route, chat_relay
from policies.routing.prompt import completion_text
from policies.tokens import COMPLETION

ROUTE = Route("completions", "/v1/completions", tokens=COMPLETION, relay=chat_relay, stream_usage=True,
              rentable=True, prompt=completion_text)
