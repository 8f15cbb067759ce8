"""Cheapest prefill first within a priority class: the `priority` a backend running vLLM's priority scheduling
gets for a call.

vLLM's scheduler with `--scheduling-policy priority` takes waiting requests by (priority, arrival). Sent as its
class's `vllm_priority` alone, a class waits in arrival order: a request whose prompt the replica holds all but its
last turn of (a prefill of a few hundred tokens) waits behind one that recomputes a whole prompt of thousands.
With `prefill_levels` above 1 the class's request goes as `vllm_priority + level`, its level the prompt tokens
the chosen replica likely has to prefill divided by the class's `level_tokens` (at most `prefill_levels - 1`):
cheap prefills first, which cuts the mean wait wherever prefills queue, as shortest-job-first does. The tokens
are what the prefix scorer did not find cached on the chosen replica (Call.routed); with no prefix scorer in the
profile, the whole prompt (the shorter prompt first). Levels never reach the next class's `vllm_priority` (the
policy refuses it), so classes keep their order.
"""

from __future__ import annotations

from policies.config import PriorityClass
from policies.pipeline import UNCACHED, Call
from policies.tokens import CHARS_PER_TOKEN


def vllm_priority(call: Call, cls: PriorityClass) -> int:
    """The `priority` to send for `call`, of class `cls`, to a backend that schedules by it."""
    if cls.prefill_levels <= 1:
        return cls.vllm_priority
    uncached = UNCACHED.get(call)
    if uncached is None:
        uncached = len(call.routing().prompt.text) / CHARS_PER_TOKEN
    return cls.vllm_priority + min(cls.prefill_levels - 1, int(uncached // cls.level_tokens))
