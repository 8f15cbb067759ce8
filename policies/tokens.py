"""A cheap estimate of what a request may cost in tokens, for reserving rate-limit budget at admission.

Exact counts need the model's tokenizer; the reservation only has to be close and is reconciled with the
backend's real `usage` when the response ends. Prompt: ~4 characters per token, plus a few per chat message
for the template. Output: max_completion_tokens, else max_tokens (max_output_tokens on Responses), else the
configured default.

Each route of the gateway declares its `Estimate` (a prompt side and an output side, below); the rate-limit step
asks the call's. A new route picks one of these or builds one from the same parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4


def count(value: object) -> int:
    """A token count a backend or provider reported: a positive int, anything else (negative, a float, a string,
    null) counts 0, so that no upstream value can lower a spend, a budget or a rate limit."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def used_tokens(usage: object) -> tuple[int, int]:
    """(prompt, completion) tokens of a call's `usage`, each read with `count`."""
    if not isinstance(usage, dict):
        return 0, 0
    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


def _text_tokens(value: Any) -> int:
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN + 1
    if isinstance(value, list):  # content parts, batched prompts, or token ids
        return sum(1 if isinstance(v, int) else _text_tokens(v) for v in value)
    if isinstance(value, dict):
        return _text_tokens(value.get("text", ""))
    return 0


def chat_prompt(body: dict[str, Any]) -> int:
    """Chat messages (OpenAI's and Anthropic's), plus a system prompt given apart (Anthropic's `system`)."""
    messages = body.get("messages")
    total = _text_tokens(body.get("system"))
    if isinstance(messages, list):
        total += sum(PER_MESSAGE + _text_tokens(m.get("content")) for m in messages if isinstance(m, dict))
    return total


def fields_prompt(*fields: str) -> Callable[[dict[str, Any]], int]:
    """The text of the given body fields (a prompt, an input, a query and its documents...)."""
    def prompt(body: dict[str, Any]) -> int:
        return sum(_text_tokens(body.get(f)) for f in fields)
    return prompt


def max_output(*fields: str) -> Callable[[dict[str, Any], int], int]:
    """The first of `fields` that is a positive integer, times `n`; else the configured default."""
    def output(body: dict[str, Any], default: int) -> int:
        for field in fields:
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                n = body.get("n")
                return value * (n if isinstance(n, int) and n > 1 else 1)
        return default
    return output


def no_output(_body: dict[str, Any], _default: int) -> int:
    return 0


def no_prompt(_body: dict[str, Any]) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class Estimate:
    """How a route's body is priced in tokens before it is sent: `prompt(body)` and `output(body, default)`."""

    prompt: Callable[[dict[str, Any]], int]
    output: Callable[[dict[str, Any], int], int]


CHAT = Estimate(chat_prompt, max_output("max_completion_tokens", "max_tokens"))
COMPLETION = Estimate(fields_prompt("prompt"), max_output("max_tokens"))
RESPONSES = Estimate(fields_prompt("instructions", "input"), max_output("max_output_tokens"))
INPUT = Estimate(fields_prompt("input"), no_output)  # embeddings, pooling, classification
FREE = Estimate(no_prompt, no_output)  # tokenizing, lookups: nothing generated, nothing reserved
