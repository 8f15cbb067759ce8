"""LoRA adapters as models against real CPU vLLM: two servers of the tiny model with `--enable-lora --max-loras 1`
and run-time loading, three adapters built offline (scripts/build_lora_adapters.py), a gateway process in front
with `max_loras: 1`. Through the openai SDK with model="<adapter>": the right adapter answers (as vLLM itself
does when asked directly), loads happen on demand on one replica, the least recently used is unloaded, a
restarted replica gets its adapter back, a key sees only its adapters, and a load that fails names the adapter.

The module's two servers pause the session's shared ones while they run (as capped_vllm does), so the two
cores serve two vLLM processes at a time. They start in the background (conftest.start_lora_servers) as soon as
the shared servers are ready, and are stopped when this module ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import gateway_process, lora_adapters_dir, need_vllm, others_paused, start_lora_servers
from tests.e2e.vllm_procs import (
    VLLMServer,
    free_port,
    start_many,
    stop_all,
)

ADAPTERS = ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")
PROMPT = [{"role": "user", "content": "Tell me about the standard library"}]


@pytest.fixture(scope="module")
def lora_vllms(tmp_path_factory, request):
    loras = lora_adapters_dir()
    need_vllm(also=loras / ".lora-adapters-complete")
    servers = start_lora_servers(request.config, tmp_path_factory)  # usually started already, in the background
    with others_paused(*servers.values()):
        try:
            start_many(servers.values(), timeout=240)  # starts any not running, waits for all
            yield servers
        finally:
            stop_all(servers.values())


@pytest.fixture(scope="module")
def lora_gateway(lora_vllms, tmp_path_factory):
    loras = lora_adapters_dir()
    adapters = [{"name": name, "path": str(loras / name)} for name in ADAPTERS]
    adapters.append({"name": "tiny-lora-missing", "path": str(loras / "no-such-adapter")})
    wide = tmp_path_factory.mktemp("tiny-lora-wide")  # an adapter whose rank is above the servers' --max-lora-rank
    shutil.copy(loras / "tiny-lora-a" / "adapter_model.safetensors", wide)
    config = json.loads((loras / "tiny-lora-a" / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 64, "lora_alpha": 128}))
    adapters.append({"name": "tiny-lora-wide", "path": str(wide)})
    policy = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": 120},
        "models": [{"name": "tiny-lora-base", "backends": [
            {"url": srv.base_url, "name": f"lora-{key}", "served_name": srv.served_model_name}
            for key, srv in lora_vllms.items()],
            "lora": {"adapters": adapters, "max_loras": 1, "refresh_seconds": 1, "load_timeout": 60}}],
    }
    with gateway_process(policy, tmp_path_factory.mktemp("lora-gateway")) as gw:
        yield gw


def sdk(gw, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key or gw.key, max_retries=0, timeout=120)


def answer(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content


def direct(server: VLLMServer, model: str) -> str:
    r = httpx.post(f"{server.api_base}/chat/completions", timeout=120, trust_env=False,
                   json={"model": model, "messages": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def held(server: VLLMServer) -> list[str]:
    """The adapters vLLM itself lists."""
    data = httpx.get(f"{server.api_base}/models", timeout=30, trust_env=False).json()["data"]
    return [m["id"] for m in data if m.get("parent")]


def holder(servers: dict[str, VLLMServer], adapter: str) -> VLLMServer:
    found = [srv for srv in servers.values() if adapter in held(srv)]
    assert len(found) == 1, {k: held(s) for k, s in servers.items()}
    return found[0]


def events(gw, event: str, adapter: str | None = None) -> float:
    labels = {"event": event, **({"adapter": adapter} if adapter else {})}
    return gw.metric("llm_gateway_lora_events_total", **labels)


def said(gw) -> str:
    """What the gateway logged of its adapters and backends (loads, unloads, a backend judged down), for a failure."""
    lines = gw.log.read_text(errors="replace").splitlines()
    return "\n".join([line for line in lines if "adapter" in line or "backend" in line][-30:])


def test_each_adapter_answers_as_vllm_does_loaded_on_demand_where_it_is_routed(lora_vllms, lora_gateway):
    gw, client = lora_gateway, sdk(lora_gateway)
    listed = {m.id: m for m in client.models.list().data}
    assert set(ADAPTERS) <= set(listed) and all(listed[a].parent == "tiny-lora-base" for a in ADAPTERS)
    base = answer(client, "tiny-lora-base")
    first = answer(client, "tiny-lora-a")
    where = holder(lora_vllms, "tiny-lora-a")  # loaded by the gateway on one replica, on demand
    assert events(gw, "load", "tiny-lora-a") == 1
    for _ in range(3):  # routed back to the holder: no second load
        assert answer(client, "tiny-lora-a") == first
    assert events(gw, "load", "tiny-lora-a") == 1
    assert direct(where, "tiny-lora-a") == first  # the adapter's own answer, as vLLM gives it directly
    second = answer(client, "tiny-lora-b")
    assert holder(lora_vllms, "tiny-lora-b") is not where  # the replica with a free slot, not over tiny-lora-a
    assert len({base, first, second}) == 3, (base, first, second)  # each adapter answers as itself
    assert events(gw, "unload") == 0


def test_the_least_recently_used_adapter_is_unloaded_at_max_loras(lora_vllms, lora_gateway):
    gw, client = lora_gateway, sdk(lora_gateway)
    a, b = answer(client, "tiny-lora-a"), answer(client, "tiny-lora-b")
    answer(client, "tiny-lora-a")  # tiny-lora-b is now the least recently used
    unloads = events(gw, "unload")
    third = answer(client, "tiny-lora-c")
    assert events(gw, "unload", "tiny-lora-b") >= 1 and events(gw, "unload") == unloads + 1, said(gw)
    assert sorted(n for srv in lora_vllms.values() for n in held(srv)) == ["tiny-lora-a", "tiny-lora-c"]
    assert all(len(held(srv)) == 1 for srv in lora_vllms.values())  # max_loras 1 on each
    assert direct(holder(lora_vllms, "tiny-lora-c"), "tiny-lora-c") == third
    assert len({a, b, third}) == 3
    assert answer(client, "tiny-lora-b") == b  # loaded again on demand, same answer


def test_a_key_sees_and_uses_only_its_adapters(lora_gateway):
    gw = lora_gateway
    cli = str(Path(sys.executable).with_name("llm-gateway"))
    created = subprocess.run([cli, "keys", "--url", gw.url, "--token", gw.admin_token(), "--json", "create",
                              "--name", "only-a", "--models", "tiny-lora-a"], check=True, capture_output=True,
                             text=True)
    client = sdk(gw, json.loads(created.stdout)["key"])
    assert [m.id for m in client.models.list().data] == ["tiny-lora-a"]
    answer(client, "tiny-lora-a")
    with pytest.raises(openai.PermissionDeniedError):
        answer(client, "tiny-lora-b")
    with pytest.raises(openai.NotFoundError):
        answer(sdk(gw), "tiny-lora-z")


def test_failed_loads_name_the_adapter_and_the_replica_stays_up(lora_vllms, lora_gateway):
    gw, client = lora_gateway, sdk(lora_gateway)
    with pytest.raises(openai.APIStatusError) as failed:
        answer(client, "tiny-lora-missing")
    assert failed.value.status_code == 502
    # vLLM's own reason, passed on (vLLM writes a path under /tmp, /root, ... as <path>: where the clone lives decides)
    assert "tiny-lora-missing" in failed.value.message and "No adapter found" in failed.value.message
    with pytest.raises(openai.APIStatusError) as wide:
        answer(client, "tiny-lora-wide")
    assert wide.value.status_code == 502 and "tiny-lora-wide" in wide.value.message, wide.value.message
    # refused at load (vLLM: HTTP 500 "LoRA rank 64 is greater than max_lora_rank 8"), not by a request that
    # reached vLLM, so the replica is not taken for unwell
    assert wide.value.code == "adapter_load_failed" and "max_lora_rank" in wide.value.message
    assert gw.metric("llm_gateway_backend_up", model="tiny-lora-base") == 2
    answer(client, "tiny-lora-base")


def test_a_restarted_replica_gets_its_adapter_back(lora_vllms, lora_gateway):
    gw, client = lora_gateway, sdk(lora_gateway)
    before = answer(client, "tiny-lora-a")
    where = holder(lora_vllms, "tiny-lora-a")
    other = next(srv for srv in lora_vllms.values() if srv is not where)
    loads = events(gw, "load", "tiny-lora-a")
    where.restart(timeout=240)  # comes back with no adapter
    assert held(where) == []
    for _ in range(3):  # every call answered: from a replica that holds the adapter or loads it again
        assert answer(client, "tiny-lora-a") == before
    assert events(gw, "load", "tiny-lora-a") >= loads + 1
    assert "tiny-lora-a" in held(where) + held(other)
