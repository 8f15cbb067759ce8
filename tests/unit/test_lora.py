"""backends/lora.py's reading of vLLM's /v1/models, and the lora-affinity scorer's preferences."""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from backends.lora import AdapterTarget, held, listed_adapters
from backends.replicas import Replica
from policies.routing.base import Note, Stats
from policies.routing.lora_affinity import LoraAffinity
from policies.routing.request import Prompt, RoutingRequest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu"


def test_adapters_are_the_entries_with_a_parent():
    base = orjson.loads((FIXTURES / "models.json").read_bytes())  # vLLM 0.32's own answer: the base model only
    assert listed_adapters(orjson.dumps(base)) == {}
    base["data"].append({**base["data"][0], "id": "ft", "parent": base["data"][0]["id"], "root": "/adapters/ft"})
    base["data"].append({"id": "no-root", "parent": "tiny"})
    assert listed_adapters(orjson.dumps(base)) == {"ft": "/adapters/ft", "no-root": None}


def test_what_is_not_a_models_answer_is_none():
    for body in (b"<html>", b"[]", b'{"data": 3}', b'{"object": "list"}'):
        assert listed_adapters(body) is None
    assert listed_adapters(b'{"data": [1, {"id": 2, "parent": "x"}, {"id": "ok", "parent": "x"}]}') == {"ok": None}


def replica(name: str, loaded: dict[str, float], max_loras: int = 1) -> Replica:
    r = Replica(name=name, model="m", url=f"http://127.0.0.1:1/{name}", served_name="m")
    state = held(r)
    state.loaded.update(loaded)
    state.max_loras = max_loras
    return r


def scores(call_adapter: AdapterTarget | None, *replicas: Replica) -> list[float]:
    request = RoutingRequest("m", "chat/completions", {}, call_adapter, Prompt({}))
    return LoraAffinity().score(request, replicas, Stats(), Note())


def test_the_holder_first_then_a_free_slot_then_the_longest_idle():
    now = time.monotonic()
    ft = AdapterTarget("ft", "/adapters/ft")
    holder, free, busy = replica("a", {"ft": now}), replica("b", {}), replica("c", {"x": now})
    assert scores(ft, holder, free, busy) == [1.0, 0.5, 0.0]
    old, recent = replica("d", {"y": now - 60}), replica("e", {"z": now})
    assert scores(ft, old, recent) == [0.25, 0.0]  # every one full: unload where the adapter idled longest
    held(old).in_use["y"] = 1  # in use: not unloaded, so the other one goes
    assert scores(ft, old, recent) == [0.0, 0.25]
    assert scores(None, holder, free, busy) == [1.0, 1.0, 1.0]  # the base model: no preference
    assert scores(AdapterTarget("ft", None), holder, free) == [1.0, 0.0]  # no path: only where it is
