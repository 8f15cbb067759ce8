"""The text a request's prompt starts with, in the order the model reads it, for prefix routing.

A route declares which of these reads its body (`Route.prompt`, gateway/endpoints/); a route that declares
none (embeddings, audio) gives routing no prompt. A pick reads it once, through its request's `Prompt`
(request.py), however many scorers ask. Chat: the tool definitions, then each message's role and
content (text parts as text, other parts and tool calls as their JSON), which is what a chat template renders
ahead of the next turn. Anthropic's Messages: the same, its system prompt first. Completions: the prompt.
Responses: instructions, then the input.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from policies.json_types import JSON

ROLE, END = "\x1e", "\x1f"  # separators that do not occur in ordinary text


def completion_text(body: Mapping[str, JSON]) -> str:
    return _text(body.get("prompt"))


def responses_text(body: Mapping[str, JSON]) -> str:
    return _text(body.get("instructions")) + END + _text(body.get("input"))


def messages_text(body: Mapping[str, JSON]) -> str:
    """Anthropic's Messages: its system prompt is a field of its own, read before the messages."""
    system = body.get("system")
    head = f"system{ROLE}{_text(system)}" if system else None
    return chat_text(body, head)


def chat_text(body: Mapping[str, JSON], head: str | None = None) -> str:
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(_json(tools))
    if head is not None:
        parts.append(head)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts.append(f"{message.get('role', '')}{ROLE}{_text(message.get('content'))}")
            if message.get("tool_calls"):
                parts.append(_json(message["tool_calls"]))
    return END.join(parts)


def _text(value: JSON) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return END.join(_part(item) for item in value)
    return _json(value)


def _part(item: JSON) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        text = item.get("text")
        if isinstance(text, str):
            return text
        if "content" in item:  # a Responses input item
            return f"{item.get('role', '')}{ROLE}{_text(item['content'])}"
    return _json(item)


def _json(value: JSON) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(value)
