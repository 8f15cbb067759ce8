"""A cheap estimate of what a request may cost in tokens, for reserving rate-limit budget at admission.

Exact counts need the model's tokenizer; the reservation only has to be close and is reconciled with the
backend's real `usage` when the response ends. Prompt: ~4 characters per token, plus a few per chat message
for the template. Output: max_completion_tokens, else max_tokens (max_output_tokens on Responses), else the
configured default.

Each route of the gateway declares its `Estimate` (a prompt side and an output side, below); the rate-limit step
asks the call's. A new route picks one of these or builds one from the same parts.

Money and budgets need more than a close guess: a prompt crafted so that each character is a token (or several)
would be reserved at a quarter of its price. `Estimate.prompt_bound` is an upper bound instead, from the same
fields: the prompt's UTF-8 bytes (a byte-level BPE tokenizer, as most served models use, makes at most one token
of each byte; SentencePiece falls back to bytes for what it does not know), token ids as given, and a few more
per chat message for the template's special tokens. The rate limits keep the estimate; the budgets reserve the
bound (policies/budget.py) and settle on the upstream's own count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

from policies.json_types import JSON, JSONView, is_int

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4
PER_MESSAGE_BOUND = 8  # a chat template's tokens around one message (ChatML: 5; Llama 3: 5), with room to spare


def count(value: object) -> int:
    """A token count a backend or provider reported: a positive int, anything else (negative, a float, a string,
    null) counts 0, so that no upstream value can lower a spend, a budget or a rate limit."""
    return value if is_int(value) and value > 0 else 0


def used_tokens(usage: object) -> tuple[int, int]:
    """(prompt, completion) tokens of a call's `usage`, each read with `count`."""
    if not isinstance(usage, dict):
        return 0, 0
    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


def _chars(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN + 1


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass")) + 1


def _text_tokens(value: JSON, per_text: Callable[[str], int] = _chars) -> int:
    if isinstance(value, str):
        return per_text(value)
    if isinstance(value, list):  # content parts, batched prompts, or token ids
        return sum(1 if isinstance(v, int) else _text_tokens(v, per_text) for v in value)
    if isinstance(value, dict):
        return _text_tokens(value.get("text", ""), per_text)
    return 0


class Prompt:
    """The prompt side of an `Estimate`: called, the estimate (4 characters a token); `bound`, an upper bound
    (a token per UTF-8 byte). Both count the same fields, so a route declares its prompt once."""

    __slots__ = ("count",)

    def __init__(self, count: Callable[[JSONView, Callable[[str], int]], int]) -> None:
        self.count = count

    def __call__(self, body: JSONView) -> int:
        return self.count(body, _chars)

    def bound(self, body: JSONView) -> int:
        return self.count(body, _bytes)


def _json_bytes(value: JSON) -> int:
    """The UTF-8 bytes of what the template renders as text besides the contents: tool definitions, a message's
    tool calls (0 when absent, so the common request pays nothing)."""
    if value is None:
        return 0
    try:
        return len(orjson.dumps(value))
    except TypeError:  # not JSON: nothing a template renders
        return 0


def _chat(body: JSONView, per_text: Callable[[str], int]) -> int:
    messages = body.get("messages")
    total = _text_tokens(body.get("system"), per_text)
    bound = per_text is _bytes
    if bound:
        total += _json_bytes(body.get("tools")) + _json_bytes(body.get("functions"))
    if isinstance(messages, list):
        extra = PER_MESSAGE_BOUND if bound else PER_MESSAGE
        for m in messages:
            if isinstance(m, dict):
                total += extra + _text_tokens(m.get("content"), per_text)
                if bound:
                    total += _json_bytes(m.get("tool_calls")) + _json_bytes(m.get("function_call"))
    return total


chat_prompt = Prompt(_chat)
"""Chat messages (OpenAI's and Anthropic's), plus a system prompt given apart (Anthropic's `system`)."""


def fields_prompt(*fields: str) -> Prompt:
    """The text of the given body fields (a prompt, an input, a query and its documents...)."""
    def count(body: JSONView, per_text: Callable[[str], int]) -> int:
        return sum(_text_tokens(body.get(f), per_text) for f in fields)
    return Prompt(count)


def max_output(*fields: str) -> Callable[[JSONView, int], int]:
    """The first of `fields` that is a positive integer, times `n`; else the configured default."""
    def output(body: JSONView, default: int) -> int:
        for field in fields:
            value = body.get(field)
            if is_int(value) and value > 0:
                n = body.get("n")
                return value * (n if isinstance(n, int) and n > 1 else 1)
        return default
    return output


def no_output(_body: JSONView, _default: int) -> int:
    return 0


def no_prompt(_body: JSONView) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class Estimate:
    """How a route's body is priced in tokens before it is sent: `prompt(body)` and `output(body, default)`."""

    prompt: Callable[[JSONView], int]
    output: Callable[[JSONView, int], int]

    def prompt_bound(self, body: JSONView) -> int:
        """At least the prompt's tokens in any tokenizer the bound knows of (the estimate where the prompt side
        has no bound of its own)."""
        bound = getattr(self.prompt, "bound", None)
        return bound(body) if bound is not None else self.prompt(body)


CHAT = Estimate(chat_prompt, max_output("max_completion_tokens", "max_tokens"))
COMPLETION = Estimate(fields_prompt("prompt"), max_output("max_tokens"))
RESPONSES = Estimate(fields_prompt("instructions", "input"), max_output("max_output_tokens"))
INPUT = Estimate(fields_prompt("input"), no_output)  # embeddings, pooling, classification
FREE = Estimate(no_prompt, no_output)  # tokenizing, lookups: nothing generated, nothing reserved
