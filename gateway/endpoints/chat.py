"""POST /v1/chat/completions: chat, streamed (`data:` chunks, a usage chunk asked for, `[DONE]`) or not."""

from gateway.endpoints.base import Route, chat_relay
from policies.routing.prompt import chat_text
from policies.tokens import CHAT

ROUTE = Route("chat/completions", "/v1/chat/completions", tokens=CHAT, relay=chat_relay, stream_usage=True,
              rentable=True, prompt=chat_text)
