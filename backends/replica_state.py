"""What the gateway keeps on each replica across policy reloads, apart from its settings: the LoRA adapters it
holds (backends/lora.py keeps them) and what outlier ejection knows of it (policies/ejection.py decides on it).
Plain state, here below both, so that backends/replicas.py can type its fields without importing either."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class Held:
    """What one replica holds: adapters by lora_name, least recently used first, with when each was last used
    (time.monotonic(); 0: not by this gateway)."""

    loaded: OrderedDict[str, float] = field(default_factory=OrderedDict)
    in_use: dict[str, int] = field(default_factory=dict)  # requests of this gateway using each adapter now
    loading: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # the single flight of each load
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # loads (of different adapters) take turns
    changed_at: dict[str, float] = field(default_factory=dict)  # monotonic time of our own last load/unload
    known: bool = False  # read from vLLM at least once
    roots: dict[str, str] = field(default_factory=dict)  # lora_name -> the path vLLM loaded it from (its `root`)
    max_loras: int | None = None  # its slots (the policy's lora.max_loras), once this gateway used it
    loads: int = 0  # loads this gateway made on it (for tests and benchmarks)
    unloads: int = 0

    def holds(self, name: str) -> bool:
        return name in self.loaded

    def touch(self, name: str) -> None:
        if name in self.loaded:
            self.loaded.move_to_end(name)
            self.loaded[name] = time.monotonic()

    def idle_since(self) -> float | None:
        """When the adapter that a load would unload here was last used (None: every one is in use)."""
        return next((at for n, at in self.loaded.items() if not self.in_use.get(n) and n not in self.loading), None)


class Outlier:
    """What ejection knows of one replica."""

    __slots__ = ("failures", "ejections", "ejected", "rule", "until", "until_unix", "returned_at", "lasted",
                 "ttft", "samples", "timer")

    def __init__(self) -> None:
        self.failures = 0  # 5xx answers and timeouts in a row
        self.ejections = 0  # ejections since it last served well (the backoff's exponent)
        self.ejected = False
        self.rule: str | None = None  # the rule that ejected it (kept after it is back, until the next one)
        self.until = 0.0  # the clock's time its ejection ends
        self.until_unix: float | None = None  # the same in unix seconds, while ejected
        self.returned_at = 0.0
        self.lasted = 0.0  # seconds its last ejection lasted
        self.ttft = 0.0  # moving average of its time to first token, seconds
        self.samples = 0
        self.timer: asyncio.TimerHandle | None = None
