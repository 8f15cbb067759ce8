"""What a console page module declares: where it lives, its title in the navigation, and its handlers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Page:
    path: str  # under /console
    title: str
    handlers: Callable[..., list]  # (gateway) -> Litestar route handlers, paths relative to /console
