"""Routing that knows vLLM, end to end: where requests land is read from each vLLM server's OWN counters
(vllm:request_success_total, vllm:prefix_cache_hits_total), never from the gateway's metrics.

Prompts are made of words the tiny model's tokenizer holds as single tokens (~10 characters a token), so a
1,500-character system prompt plus a growing conversation fits the servers' 512-token context.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import e2e_policy, gateway_process
from tests.e2e.vllm_procs import VLLMServer, free_port
from tests.support.probes import metric_sum

WORDS = """absolute abstract according additional appropriate arbitrary attribute automatically available boundary
callback category character collections comparison compatibility component compression condition configuration
connection constructor containing corresponding description dictionary difference different documentation
equivalent exception expression extension following implementation information interface interpreter language
necessary operation parameter position precision protocol recursive reference registered relative remainder
representation response sequence""".split()

SUCCESS, PREFIX_HITS = "vllm:request_success_total", "vllm:prefix_cache_hits_total"


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def system_prompt(tag: str, chars: int = 1500) -> str:
    """A long system prompt that differs from its first characters on (so no block of it is shared)."""
    return f"{tag}: " + words(random.Random(tag), chars)


def counters(servers: dict[str, VLLMServer], name: str) -> dict[str, float]:
    """A counter of each running server (a stopped one counts nothing)."""
    return {key: metric_sum(srv.metrics_text(), name) for key, srv in servers.items() if srv.is_running()}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def served_by(servers: dict[str, VLLMServer], before: dict[str, float], expected: int = 1) -> dict[str, float]:
    """How many requests each server finished since `before`, once `expected` more have finished in all (vLLM
    may count a request a moment after its answer is out)."""
    def delta():
        now = counters(servers, SUCCESS)
        d = {key: now[key] - before[key] for key in before if key in now}
        return d if sum(d.values()) >= expected else None

    return wait_for(delta, 20, f"vLLM to count {expected} finished request(s)")


class Conversation:
    """One chat growing turn by turn through the gateway's `duo` model, each turn attributed to the vLLM server
    that counted it."""

    def __init__(self, client: openai.OpenAI, tag: str) -> None:
        self.client, self.tag = client, tag
        self.rng = random.Random(f"{tag}-turns")
        self.messages = [{"role": "system", "content": system_prompt(tag)}]
        self.servers_per_turn: list[str] = []

    def turn(self, servers: dict[str, VLLMServer]) -> str:
        self.messages.append({"role": "user", "content": f"{self.tag} " + words(self.rng, 60)})
        before = counters(servers, SUCCESS)
        raw = self.client.chat.completions.with_raw_response.create(
            model="duo", messages=self.messages, max_tokens=4, temperature=0)
        assert raw.http_response.status_code == 200
        reply = raw.parse()
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        delta = served_by(servers, before)
        assert sum(delta.values()) == 1, f"one request, counted as {delta}"
        server = next(key for key, n in delta.items() if n == 1)
        self.servers_per_turn.append(server)
        return server


@pytest.fixture(scope="module")
def client(gateway):
    # modules before this one may have paused the shared servers (for vLLMs of their own): the session's gateway
    # takes them back within its health backoff once they answer again
    wait_for(lambda: all(gateway.metric("llm_gateway_backend_up", backend=f"duo-{s}") == 1 for s in "ab"), 60,
             "both of duo's replicas to be up")
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key, max_retries=0, timeout=60) as c:
        yield c


def test_each_conversation_stays_on_one_replica_and_hits_its_prefix_cache(client, vllm_servers):
    run = secrets.token_hex(3)
    conversations = [Conversation(client, f"conversation {i} of run {run}") for i in range(5)]
    hits_before = counters(vllm_servers, PREFIX_HITS)
    hits_per_conversation = {c.tag: 0.0 for c in conversations}
    for turn in range(4):
        for conv in conversations:  # interleaved: every conversation's turn k, then every one's turn k + 1
            hits = counters(vllm_servers, PREFIX_HITS)
            server = conv.turn(vllm_servers)
            if turn > 0:
                hits_per_conversation[conv.tag] += metric_sum(vllm_servers[server].metrics_text(), PREFIX_HITS) \
                    - hits[server]
    placement = {c.tag: c.servers_per_turn for c in conversations}
    for conv in conversations:
        assert len(set(conv.servers_per_turn)) == 1, f"a conversation's turns were split: {placement}"
    # vLLM itself found each conversation's earlier turns in its prefix cache: at least the system prompt
    # (~150 tokens) on every later turn
    for tag, hits in hits_per_conversation.items():
        assert hits >= 3 * 64, f"{tag}: only {hits} prefix-cache hit tokens in turns 2-4; placement {placement}"
    hits_after = counters(vllm_servers, PREFIX_HITS)
    for key in {c.servers_per_turn[0] for c in conversations}:
        assert hits_after[key] > hits_before[key]


def test_a_conversation_moves_when_its_replica_stops_and_stays_after_it_returns(client, gateway, vllm_servers):
    conv = Conversation(client, f"failover conversation of run {secrets.token_hex(3)}")
    home = conv.turn(vllm_servers)
    assert conv.turn(vllm_servers) == home
    other = next(key for key in vllm_servers if key != home)
    stopped = vllm_servers[home]
    stopped.stop()
    try:
        # the first turn after the stop still picks the stopped replica (its prefix is there), fails to connect
        # and is sent to the other one: the client sees an answer, never an error
        for _ in range(3):
            assert conv.turn(vllm_servers) == other, conv.servers_per_turn
    finally:
        stopped.restart()
    wait_for(lambda: gateway.metric("llm_gateway_backend_up", backend=f"duo-{home}") == 1, 30, "the replica to rejoin")
    # the conversation's cache now lives on the other replica (the restarted one starts empty): it stays there
    for _ in range(2):
        assert conv.turn(vllm_servers) == other, conv.servers_per_turn
    assert conv.servers_per_turn == [home] * 2 + [other] * 5
    # the models served only by the restarted server are back too, for the tests that follow
    wait_for(lambda: httpx.get(f"{gateway.url}/ready").json()["status"] == "ready", 30, "the gateway to be ready again")


HOT_GUARDED, HOT_UNGUARDED = "hot", "hot-unguarded"


@pytest.fixture(scope="module")
def guard_gateway(vllm_servers, tmp_path_factory):
    """A second gateway whose two models share the two servers and differ only in the load guard: `hot` has
    prefix-affinity's default guard, `hot-unguarded` none (`guard: false`)."""
    policy = e2e_policy(vllm_servers, free_port())
    duo = next(m for m in policy["models"] if m["name"] == "duo")

    def model(name: str, profile: str) -> dict:
        backends = [{**b, "name": b["name"].replace("duo", name)} for b in duo["backends"]]
        return {**duo, "name": name, "backends": backends, "routing": profile}

    policy["models"] = [model(HOT_GUARDED, "guarded"), model(HOT_UNGUARDED, "unguarded")]

    def profile(guard: bool) -> dict:
        return {"scorers": [{"name": "prefix-affinity", "weight": 4, "params": {"guard": guard}},
                            {"name": "vllm-queue", "weight": 2}, {"name": "least-in-flight", "weight": 1}]}

    policy["routing"] = {"profiles": {"guarded": profile(True), "unguarded": profile(False)}}
    with gateway_process(policy, tmp_path_factory.mktemp("guard-gateway")) as gw:
        yield gw


async def burst(gw, model: str, prompt: str, n: int) -> list[int]:
    """n requests with the same long system prompt, all sent at once, each generating 200 tokens."""
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.key, max_retries=0, timeout=120) as c:
        replies = await asyncio.gather(*(
            c.chat.completions.with_raw_response.create(
                model=model, max_tokens=200, extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": prompt}, {"role": "user", "content": f"request {i}"}])
            for i in range(n)))
    return [r.http_response.status_code for r in replies]


def test_load_guard_spreads_a_hot_prefix_that_would_otherwise_pile_on_one_replica(guard_gateway, vllm_servers):
    n, run = 8, secrets.token_hex(3)
    # the guard compares loads, and the gateway's view of vLLM's lags by up to a scrape: start from idle servers
    # (this gateway started after the earlier tests had finished, so it has seen nothing else)
    idle = lambda: all(metric_sum(srv.metrics_text(), name) == 0 for srv in vllm_servers.values()  # noqa: E731
                       for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    wait_for(idle, 30, "both vLLM servers to be idle")
    spread = {}
    # guarded first: the unguarded burst is indifferent to stale loads (affinity's 4 outweighs load's 2 + 1)
    for model in (HOT_GUARDED, HOT_UNGUARDED):
        before = counters(vllm_servers, SUCCESS)
        statuses = asyncio.run(burst(guard_gateway, model, system_prompt(f"hot prefix for {model} of run {run}"), n))
        assert statuses == [200] * n
        spread[model] = served_by(vllm_servers, before, expected=n)
        assert sum(spread[model].values()) == n, spread
    # with the guard, the prompt seen again is a shared prefix: it goes by load while the first replica is busier,
    # so the second replica serves (and learns) it too
    assert all(count > 0 for count in spread[HOT_GUARDED].values()), spread
    # without it, affinity outweighs the load scorers: every request on the replica the first one went to
    assert sorted(spread[HOT_UNGUARDED].values()) == [0, n], spread
