"""How long a request's client waits for the first byte of its answer: its deadline, read once at the edge.

The openai and anthropic SDKs send their timeout with every request: `x-stainless-read-timeout` (both: seconds
the client waits for a byte of the answer before it gives up, and retries) and `x-stainless-timeout`
(anthropic's whole timeout). The gateway sends nothing before a slot is found and the replica's head is in, so
past the earliest of them the client has gone: a request still queued then is refused (a 429 it may retry on,
never a call to a replica nobody waits for), one that cannot expect a slot before it is refused at once, and a
failed attempt is not retried past it (policies/admission.py, gateway/attempts.py). Values that are not a positive
number of seconds (or are longer than a day) are ignored: a client without them waits as long as the policy lets
it (`queue.max_wait`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

HEADERS = ("x-stainless-read-timeout", "x-stainless-timeout")
LONGEST = 86_400.0  # seconds: a longer (or unreadable) timeout is no deadline
MAX_LENGTH = 32  # characters of a header value read as a number


def seconds_of(raw: str | None) -> float | None:
    if raw is None or len(raw) > MAX_LENGTH:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        return None
    return seconds if 0.0 < seconds <= LONGEST else None  # NaN and inf compare false or exceed


def deadline_of(headers: Mapping[str, str], arrived: float) -> float:
    """perf_counter() past which the client of a request that arrived at `arrived` no longer waits (inf: none)."""
    shortest = math.inf
    for name in HEADERS:
        seconds = seconds_of(headers.get(name))
        if seconds is not None and seconds < shortest:
            shortest = seconds
    return arrived + shortest
