"""Reading a policy file: YAML without duplicate keys, validated whole, every problem named by its place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from policies.config.base import PolicyError
from policies.config.policy import Policy


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in keys:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the policy file must be a mapping with at least `models:`")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"{source}: invalid policy\n" + format_errors(exc, data)) from None


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_policy(text, str(path))


def format_errors(exc: ValidationError, data: Any) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        where = _location(err["loc"], data)
        if err["type"] == "extra_forbidden":
            message = "unknown field (not part of the policy schema)"
        elif err["type"] == "missing":
            message = "required field is missing"
        else:
            message = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err['input']!r:.80})"
        lines.append(f"  {where}: {message}{got}")
    return "\n".join(lines)


def _location(loc: tuple[Any, ...], data: Any) -> str:
    """models.0.backends.1.url -> models[0](name=chat).backends[1].url, so the reader finds it in the file."""
    out = ""
    node = data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                out += f"(name={node['name']})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "<root>"
