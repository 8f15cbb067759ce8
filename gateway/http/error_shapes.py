"""The error shapes the edge answers in, by route family: Anthropic's on /v1/messages (its SDK raises the right
class from `type`), OpenAI's everywhere else (GatewayError.body)."""

from __future__ import annotations

import orjson

from policies.auth import INVALID
from policies.errors import GatewayError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
         529: "overloaded_error"}


INVALID_KEY = ("Incorrect or missing API key. Pass one valid key as `x-api-key: sk-...` (or as `Authorization:"
               " Bearer`, not both with different keys).")


def anthropic_error(error: GatewayError) -> bytes:
    kind = TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = INVALID_KEY if error.message == INVALID else error.message  # these clients send the key as x-api-key
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
