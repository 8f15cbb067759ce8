"""Set `cap: N` on one backend of a policy file, and change nothing else in it.

A YAML round trip (load, set, dump) re-indents lists, re-quotes strings and loses or moves comments, and a
policy file is read and reviewed by people. So this edits the text: PyYAML's composer gives the position of
every node, and the edit is either the existing `cap` value replaced in place or one new `cap: N` line after
the backend's last key, at that mapping's indentation (`, cap: N` in a flow mapping `{...}`). The result
must load to exactly the old document with that one value set, and must pass policies.config.parse_policy,
before it atomically replaces the file (same directory, same mode, through a symlink to its target).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from policies.config import PolicyError, backend_name, parse_policy


class CapFileError(Exception):
    """The cap cannot be written; the message says why and leaves the file as it was."""


def locate(text: str, backend: str, source: str = "<policy>") -> tuple[int, int, int | None]:
    """(model index, backend index, current cap) of the backend named `backend` (explicit name or <model>-<i>)."""
    try:
        policy = parse_policy(text, source)
    except PolicyError as exc:
        raise CapFileError(f"the policy file is not valid as it is, so it is left alone:\n{exc}") from None
    names = []
    for i, model in enumerate(policy.models):
        for j, b in enumerate(model.backends):
            name = backend_name(model, j)
            if name == backend:
                return i, j, b.cap
            names.append(name)
    raise CapFileError(f"{source}: no backend named {backend!r}; backends: {', '.join(names)} "
                       "(a backend's name is its `name`, else <model>-<index>)")


def set_cap(text: str, backend: str, cap: int, source: str = "<policy>") -> str:
    """The policy text with `cap: <cap>` on `backend`; raises CapFileError if that cannot be done cleanly."""
    if not isinstance(cap, int) or cap < 1:
        raise CapFileError(f"cap must be a positive integer, got {cap!r}")
    i, j, _ = locate(text, backend, source)
    node = _backend_node(yaml.compose(text, Loader=yaml.SafeLoader), i, j)
    new = _edit(text, node, cap)
    expected = _tree(yaml.safe_load(text))
    expected["models"][i]["backends"][j]["cap"] = cap
    if _tree(yaml.safe_load(new)) != expected:
        raise CapFileError(f"{source}: cannot set the cap by a local edit (YAML anchors or merge keys around "
                           f"{backend!r}?); set `cap: {cap}` by hand")
    try:
        parse_policy(new, source)
    except PolicyError as exc:
        raise CapFileError(f"the edited policy would not be valid, so the file is left alone:\n{exc}") from None
    return new


def write_cap(path: str | os.PathLike[str], backend: str, cap: int) -> int | None:
    """Set the cap in the file at `path`, atomically; returns the backend's previous cap."""
    target = Path(path).resolve()
    try:
        with open(target, encoding="utf-8", newline="") as f:  # newline="": keep CRLF files CRLF
            text = f.read()
        mode = target.stat().st_mode & 0o7777
    except OSError as exc:
        raise CapFileError(f"{path}: cannot read: {exc.strerror}") from None
    previous = locate(text, backend, str(path))[2]
    new = set_cap(text, backend, cap, str(path))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise CapFileError(f"{path}: cannot write: {exc.strerror}") from None
    return previous


def _tree(data: object) -> Any:
    """A copy with no shared parts: YAML aliases load as one shared object, which would hide a double edit."""
    return json.loads(json.dumps(data, default=str))


def _value(mapping: yaml.Node, key: str) -> yaml.Node | None:
    pairs: list[tuple[yaml.Node, yaml.Node]] = mapping.value
    for k, v in pairs:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    return None


def _backend_node(root: yaml.Node | None, i: int, j: int) -> yaml.MappingNode:
    assert root is not None  # locate() found the backend at (i, j), so these nodes are there
    models = _value(root, "models")
    assert models is not None
    backends = _value(models.value[i], "backends")
    assert backends is not None
    node: yaml.MappingNode = backends.value[j]
    return node


def _edit(text: str, node: yaml.MappingNode, cap: int) -> str:
    current = _value(node, "cap")
    if current is not None:  # replace the value in place: its comment and the key's position stay
        return text[:current.start_mark.index] + str(cap) + text[current.end_mark.index:]
    pairs: list[tuple[yaml.Node, yaml.Node]] = node.value
    end = pairs[-1][1].end_mark.index
    if node.flow_style:
        return text[:end] + f", cap: {cap}" + text[end:]
    eol = "\r\n" if "\r\n" in text else "\n"
    line = " " * pairs[0][0].start_mark.column + f"cap: {cap}"
    if end == 0 or text[end - 1] == "\n":  # a block scalar ends at the start of the next line
        return text[:end] + line + eol + text[end:]
    nl = text.find("\n", end)  # after the last key's line, with its end-of-line comment
    if nl == -1:
        return text + eol + line + eol
    if text[nl - 1] == "\r":
        nl -= 1
    return text[:nl] + eol + line + text[nl:]
