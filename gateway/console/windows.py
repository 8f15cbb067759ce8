"""The windows a console page offers for its figures (the admin API takes any number of seconds)."""

from __future__ import annotations

WINDOWS = ((3600, "last hour"), (6 * 3600, "last 6 hours"), (86400, "last day"), (7 * 86400, "last week"),
           (30 * 86400, "last 30 days"))
DEFAULT = 3600


def window_of(seconds: int | None) -> int:
    """One of WINDOWS (the default for anything else)."""
    return seconds if seconds in dict(WINDOWS) else DEFAULT
