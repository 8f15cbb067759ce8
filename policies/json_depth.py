"""How deep a JSON value may nest, checked without recursing in Python.

Every JSON body the gateway reads (an OpenAI or Anthropic request, an admin body, a batch file's line) is held to
MAX_JSON_DEPTH before any code walks or re-encodes it: orjson reads up to 1024 levels but writes at most 254 (a
deeper body could not be forwarded), and Python code walking a deeper value (policies/tokens.py) would recurse.
"""

from __future__ import annotations

import threading

import orjson

# Levels of nesting a JSON body may have (the top object is level 1). OpenAI and Anthropic bodies, tool schemas
# included, nest some 20 deep; past this bound a body is refused (400) before any code walks or re-encodes it:
# orjson reads up to 1024 levels but writes at most 254 (a deeper body could not be forwarded), and Python code
# walking a deeper value (policies/tokens.py) would recurse.
MAX_JSON_DEPTH = 128


def _orjson_write_limit() -> int | None:
    """The most levels orjson.dumps writes (254 in orjson 3), or None if it writes all that loads reads."""
    def writes(levels: int) -> bool:
        value: list[object] = []
        for _ in range(levels - 1):
            value = [value]
        try:
            orjson.dumps(value)
        except TypeError:
            return False
        return True

    if writes(1025):
        return None
    low, high = MAX_JSON_DEPTH, 1025  # writes(low), not writes(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if writes(mid) else (low, mid)
    return low


_WRITE_LIMIT = _orjson_write_limit()
_PADDING = threading.local()  # per thread: the nested lists a value is checked inside


def _padding() -> tuple[list[object], list[object]]:
    """(outer, inner): `_WRITE_LIMIT - MAX_JSON_DEPTH` nested lists, `inner` the deepest, empty between uses."""
    found = getattr(_PADDING, "lists", None)
    if found is None:
        outer: list[object] = []
        inner = outer
        for _ in range((_WRITE_LIMIT or 0) - MAX_JSON_DEPTH - 1):
            deeper: list[object] = []
            inner.append(deeper)
            inner = deeper
        found = _PADDING.lists = (outer, inner)
    return found


def too_deep(value: object) -> bool:
    """Whether a parsed JSON `value` nests past MAX_JSON_DEPTH, without recursing in Python. Put inside the
    padding lists, it nests past orjson's write limit exactly when it nests past the bound, so orjson itself
    checks it (about a quarter of the time orjson took to read it, measured on bodies of 0.4-47 KB). An orjson
    that writes any depth would leave the walk, level by level over the containers, to do it."""
    if _WRITE_LIMIT is None:
        level = [value] if type(value) is dict or type(value) is list else []
        for _ in range(MAX_JSON_DEPTH):
            level = [c for v in level for c in (v.values() if type(v) is dict else v)
                     if type(c) is dict or type(c) is list]
            if not level:
                return False
        return True
    outer, inner = _padding()
    inner.append(value)
    try:
        orjson.dumps(outer)
    except TypeError as exc:
        return "recursion" in str(exc).lower()
    finally:
        inner.clear()
    return False


def json_too_deep(what: str) -> str:
    return f"{what} nests deeper than the {MAX_JSON_DEPTH} levels of JSON this gateway accepts"


def nests_past_bound(raw: bytes | memoryview, value: object) -> bool:
    """too_deep(value), for a `value` parsed from `raw`: skipped (cheap) when `raw` holds fewer brackets than the
    bound, as most bodies do."""
    data = bytes(raw) if isinstance(raw, memoryview) else raw
    return data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and too_deep(value)
