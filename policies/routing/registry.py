"""Every routing plugin by the name the policy file uses. A new plugin is one module and one line here."""

from __future__ import annotations

from policies.routing.base import Filter, PickerClass, Plugin, Scorer
from policies.routing.filters import KVHeadroom
from policies.routing.kv_cache import KVCache
from policies.routing.least_in_flight import LeastInFlight
from policies.routing.lora_affinity import LoraAffinity
from policies.routing.pickers import MaxScore, Random
from policies.routing.precise_prefix import PrecisePrefix
from policies.routing.prefix_affinity import PrefixAffinity
from policies.routing.prefix_cost import PrefixCost
from policies.routing.session_affinity import SessionAffinity
from policies.routing.vllm_queue import VLLMQueue

FILTERS: dict[str, Plugin[Filter]] = {f.name: f for f in (Plugin[Filter](KVHeadroom),)}
SCORERS: dict[str, Plugin[Scorer]] = {s.name: s for s in (
    Plugin[Scorer](LeastInFlight), Plugin[Scorer](VLLMQueue), Plugin[Scorer](KVCache), Plugin[Scorer](PrefixAffinity),
    Plugin[Scorer](SessionAffinity), Plugin[Scorer](PrecisePrefix), Plugin[Scorer](LoraAffinity),
    Plugin[Scorer](PrefixCost),
)}
PICKERS: dict[str, PickerClass] = {p.name: p for p in (MaxScore, Random)}
