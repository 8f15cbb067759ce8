"""The text a request's prompt starts with, in the order the model reads it, for prefix routing.

Chat: the tool definitions, then each message's role and content (text parts as text, other parts and tool
calls as their JSON), which is what a chat template renders ahead of the next turn. Completions: the prompt.
Responses: instructions, then the input. Anything else (embeddings, audio): empty, so routing ignores it.
"""

from __future__ import annotations

from typing import Any

import orjson

ROLE, END = "\x1e", "\x1f"  # separators that do not occur in ordinary text


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    if endpoint == "chat/completions":
        return chat_text(body)
    if endpoint == "completions":
        return _text(body.get("prompt"))
    if endpoint == "responses":
        return _text(body.get("instructions")) + END + _text(body.get("input"))
    return ""


def chat_text(body: dict[str, Any]) -> str:
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(_json(tools))
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts.append(f"{message.get('role', '')}{ROLE}{_text(message.get('content'))}")
            if message.get("tool_calls"):
                parts.append(_json(message["tool_calls"]))
    return END.join(parts)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return END.join(_part(item) for item in value)
    return _json(value)


def _part(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if isinstance(item.get("text"), str):
            return item["text"]
        if "content" in item:  # a Responses input item
            return f"{item.get('role', '')}{ROLE}{_text(item['content'])}"
    return _json(item)


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(value)
