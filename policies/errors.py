"""Every way a request can fail, and the one OpenAI error object each becomes.

The openai SDK picks its exception class from the HTTP status, so the status is the contract:

    GatewayError                      any failure the client sees; renders {"error": {message, type, param, code}}
     +-- BadRequest             400   malformed JSON, missing/invalid fields       -> openai.BadRequestError
     +-- AuthenticationFailed   401   missing/unknown/expired/revoked API key      -> openai.AuthenticationError
     +-- PermissionDenied       403   key may not use this model / network         -> openai.PermissionDeniedError
     +-- NotFound               404   unknown model or path                        -> openai.NotFoundError
     +-- MethodNotAllowed       405   wrong HTTP method on a known path
     +-- PayloadTooLarge        413   body over the configured limit
     +-- RateLimited            429   a limit or queue refused it (Retry-After)    -> openai.RateLimitError
     +-- UpstreamStatus         4xx   a backend's own 4xx, its body passed through unchanged
     +-- InternalError          500   a bug in the gateway; never carries details
     +-- UpstreamFailed         502   the backend broke (5xx, reset, bad stream)   -> openai.APIStatusError
     +-- NoBackendAvailable     503   no healthy replica for the model             -> openai.APIStatusError
     |   +-- OverBudget         503   none, and the key's rented budget is spent (else it waits for one)
     +-- StateUnavailable       503   the key/limit store (Redis) cannot be reached
     +-- UpstreamTimeout        504   the backend did not answer in time

Every 503 says when to try again (`retry_after`, sent as Retry-After): a 503 is a state that passes (a backend
coming back, a store failing over), and clients and SDKs back off by it instead of hammering or giving up.

Messages never contain secrets: callers pass only what is safe to show (never a key, token or header value).
"""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | int | None = None  # upstream errors pass on vLLM's own: its HTTP status
    retry_after: int | None = None  # seconds, sent as Retry-After: every 503 says when to try again

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}
        if self.retry_after is not None:
            self.headers.setdefault("retry-after", str(self.retry_after))

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        )


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class InternalError(GatewayError):
    status = 500
    type = "server_error"
    code = "internal_error"


class UpstreamFailed(GatewayError):
    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class NoBackendAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_backend_available"
    retry_after = 1  # a replica that is out is probed again after health.backoff_initial (1 s by default)


class OverBudget(NoBackendAvailable):
    """The call would have spilled to a rented provider, but its key's rented budget is spent: it waits for an
    owned replica instead, or, when none is up, gets this 503."""

    code = "rented_budget_spent"


class NotRentable(NoBackendAvailable):
    """The call would have spilled to a rented provider, but its key's current record no longer allows it (made
    `private_only`, revoked, its team made private since the call was admitted): it waits for an owned replica
    instead, or, when none is up, gets this 503."""

    code = "rented_not_allowed"


class StateUnavailable(GatewayError):
    """The shared store is unreachable (an outage, or a failover until the new primary answers): retry soon."""

    status = 503
    type = "service_unavailable"
    code = "store_unavailable"
    retry_after = 2  # seconds: about one Sentinel or Cluster failover (down-after + election)


class UpstreamTimeout(GatewayError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class UpstreamStatus(GatewayError):
    """A backend refused the request itself (4xx): its OpenAI error body reaches the client unchanged; any other
    body (vLLM's own `{"detail": "Not Found"}`, a proxy's HTML) is wrapped in an OpenAI error object with the
    same status, its message taken from `detail` or the text and bounded."""

    type = "invalid_request_error"

    def __init__(self, status: int, raw_body: bytes) -> None:
        self.raw_body = raw_body
        self.openai_shaped, message = upstream_text(raw_body)
        super().__init__(message)
        self.status = self.code = status  # vLLM's own errors carry the status as their code

    def body(self) -> bytes:
        return self.raw_body if self.openai_shaped else super().body()


MESSAGE_LIMIT = 500  # characters of a backend's own error text the client sees


def upstream_text(raw: bytes) -> tuple[bool, str]:
    """(whether `raw` is an OpenAI error object, the message to show)."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):  # OpenAI's shape, or Anthropic's ({"type": "error", "error": {...}})
            message = error.get("message")
            return parsed.get("type") != "error", (message if isinstance(message, str) else str(error))[:MESSAGE_LIMIT]
        detail = parsed.get("detail", parsed)
        text = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
    else:
        text = raw.decode("utf-8", "replace").strip()
    return False, (text[:MESSAGE_LIMIT] or "the backend refused the request")
