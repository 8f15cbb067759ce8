"""Pipeline step: record each finished request's usage (tokens by key and model) in the store.

The write is handed to the gateway's background runner, so the client never waits on the store.
"""

from __future__ import annotations

from gateway.pipeline import Call
from policies.store import Store


def _tokens(usage: object, field: str) -> int:
    value = usage.get(field) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and value > 0 else 0


class RecordUsage:
    name = "record-usage"

    def __init__(self, store: Store, background) -> None:
        self.store = store
        self.background = background

    async def enter(self, call: Call) -> None:
        pass

    async def leave(self, call: Call) -> None:
        if call.key is None or not call.model or call.replica is None:
            return  # refused before reaching a backend: nothing was used
        self.background(
            self.store.add_usage(
                call.key.id,
                call.model,
                requests=1,
                prompt_tokens=_tokens(call.usage, "prompt_tokens"),
                completion_tokens=_tokens(call.usage, "completion_tokens"),
                rented=call.replica.rented is not None,
            )
        )
