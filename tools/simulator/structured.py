"""Structured answers of the simulator: JSON for `response_format`, tool calls for `tools`, and a set share of
them corrupted, the way a model served with a bad quantisation breaks JSON and function calls.

The engine still decides how long an answer takes (its tokens and steps); only the text it carries is a JSON
document made from the request's schema instead. With `corrupt_fraction` f, the answers are corrupted evenly:
the n-th structured answer is broken exactly when floor((n + 1) f) > floor(n f), so any run of answers holds
that share to within one, and a test can know the rate it set. A broken answer lacks its closing brace: not
JSON at all, as a model that stopped mid-object returns it.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import orjson

STRUCTURED = ("json_object", "json_schema")


def instance_of(schema: Any, depth: int = 0) -> Any:
    """A small value valid against a simple JSON schema (types, properties, enum, const, minimum, items)."""
    if not isinstance(schema, dict) or depth > 8:
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: instance_of(sub, depth + 1) for name, sub in props.items()}
    if kind == "array":
        return [instance_of(schema.get("items") or {}, depth + 1) for _ in range(schema.get("minItems", 0))]
    if kind == "integer":
        return int(max(schema.get("minimum", 1), 1))
    if kind == "number":
        return float(max(schema.get("minimum", 1.5), 1.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "x" * max(1, schema.get("minLength", 5))


class Structured:
    """What a structured request's answer holds, decided when it arrives."""

    def __init__(self, text: str, tool: str | None) -> None:
        self.text = text  # the content (the JSON document), or the tool call's arguments
        self.tool = tool  # the called function's name; None: a JSON content answer
        self.call_id = f"chatcmpl-tool-{secrets.token_hex(8)}" if tool else None


class Corruptor:
    """Decides, per structured answer, whether it is broken (evenly, at `fraction`)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.count = 0

    def next_broken(self) -> bool:
        n, self.count = self.count, self.count + 1
        return math.floor((n + 1) * self.fraction) > math.floor(n * self.fraction)


def structured_answer(body: Any, tool_calling: bool, corruptor: Corruptor) -> Structured | None:
    """The structured answer a chat request asks for, or None when it asks for none."""
    tools = body.tools if tool_calling and body.tools and body.tool_choice != "none" else None
    fmt = getattr(body, "response_format", None)
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if tools:
        function = tools[0].get("function") or {}
        choice = body.tool_choice
        if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            named = choice["function"].get("name")
            function = next((t.get("function") or {} for t in tools if (t.get("function") or {}).get("name") == named),
                            function)
        value, tool = instance_of(function.get("parameters") or {}), function.get("name") or "tool"
    elif kind in STRUCTURED:
        assert isinstance(fmt, dict)  # kind was read from it
        spec = fmt.get("json_schema") if kind == "json_schema" else None
        value = instance_of(spec.get("schema") if isinstance(spec, dict) else {"type": "object", "properties": {
            "answer": {"type": "string"}}})
        tool = None
    else:
        return None
    text = orjson.dumps(value).decode()
    if corruptor.next_broken():
        text = text[:-1]  # the closing brace is missing: not JSON
    return Structured(text, tool)

