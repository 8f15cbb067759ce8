"""What a console page module declares: where it lives, its title in the navigation, its handlers, and whether a
team admin may open it (a page marked `team` shows a team admin its own team's part only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Page:
    path: str  # under /console
    title: str
    handlers: Callable[..., list]  # (gateway) -> Litestar route handlers, paths relative to /console
    team: bool = False  # a team admin may open it: each of its handlers is marked opt={"team": True} too
