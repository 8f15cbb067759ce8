"""The type of a parsed JSON value, for the bodies and answers a call carries: what orjson.loads can return, named
so that code reading a client's or a backend's JSON must look at what it got (isinstance) before using it."""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
JSONObject: TypeAlias = "dict[str, JSON]"
