"""What a console page module declares: where it lives, its title in the navigation, its handlers, and whether a
team admin may open it (a page marked `team` shows a team admin its own team's part only).

A page's handlers take the gateway through the Protocol its module declares (`G`): what that page reads of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from litestar.handlers import HTTPRouteHandler

G = TypeVar("G", contravariant=True)


@dataclass(frozen=True, slots=True)
class Page(Generic[G]):
    path: str  # under /console
    title: str
    handlers: Callable[[G], list[HTTPRouteHandler]]  # (gateway) -> route handlers, paths relative to /console
    team: bool = False  # a team admin may open it: each of its handlers is marked opt={"team": True} too
