"""The type of a parsed JSON value, for the bodies and answers a call carries: what orjson.loads can return, named
so that code reading a client's or a backend's JSON must look at what it got (isinstance) before using it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias, TypeGuard

JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
JSONObject: TypeAlias = "dict[str, JSON]"
JSONView: TypeAlias = "Mapping[str, JSON]"  # a JSON object that is read, never written (a call's body)


def is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: an int that is not a bool (JSON's true and false are Python's bools, which are ints)."""
    return isinstance(value, int) and not isinstance(value, bool)
