"""A cheap estimate of what a request may cost in tokens, for reserving rate-limit budget at admission.

Exact counts need the model's tokenizer; the reservation only has to be close and is reconciled with the
backend's real `usage` when the response ends. Prompt: ~4 characters per token, plus a few per chat message
for the template. Output: max_completion_tokens, else max_tokens, else the configured default.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4


def _text_tokens(value: Any) -> int:
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN + 1
    if isinstance(value, list):  # content parts, batched prompts, or token ids
        return sum(1 if isinstance(v, int) else _text_tokens(v) for v in value)
    if isinstance(value, dict):
        return _text_tokens(value.get("text", ""))
    return 0


def prompt_tokens(endpoint: str, body: dict[str, Any]) -> int:
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(PER_MESSAGE + _text_tokens(m.get("content")) for m in messages if isinstance(m, dict))
    if endpoint == "completions":
        return _text_tokens(body.get("prompt"))
    return _text_tokens(body.get("input"))


def output_tokens(endpoint: str, body: dict[str, Any], default: int) -> int:
    if endpoint == "embeddings":
        return 0
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if isinstance(value, int) and value > 0:
            n = body.get("n")
            return value * (n if isinstance(n, int) and n > 1 else 1)
    return default
