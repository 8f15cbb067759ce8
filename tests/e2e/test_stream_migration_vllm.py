"""Streams that survive on real vLLM servers (gateway/migration.py): the session's two servers serve one model
(`duo`) through a gateway of this module's own, with a short read timeout and one migration allowed. At
temperature 0, a stream whose replica is stopped half-way (SIGSTOP, past the read timeout) or killed (SIGKILL:
its connection resets) goes on from the other replica, and the client reads, through the unmodified openai SDK,
one stream under one response id with, word for word, the text of an uninterrupted run: the continuation is the
prompt's token ids and the generated ones as vLLM said them (nothing re-tokenized), and the ids the gateway
asked for never reach the client. A call that is not streamed needs no migration: stopped mid-generation, its
replica sends no head, and the call is retried on the other (the same text again). A stopped server is resumed
(SIGCONT), a killed one started again, however the test ends. A Messages or Responses stream is asked again of
the other replica and cut where the client's text ends (gateway/stream_replay.py, gateway/responses_replay.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from tests.e2e.conftest import gateway_process
from tests.e2e.vllm_procs import VLLMServer, free_port

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
MAX = 320  # tokens: the stream runs long enough to be cut half-way (prompt + output within --max-model-len 512)
CUT = 40  # chunks read before the serving replica is stopped
READ_TIMEOUT = 6.0
WHOLE_MAX = 96  # tokens of the call that is not streamed: its whole answer comes well inside READ_TIMEOUT


@pytest.fixture(scope="module")
def migrating(vllm_servers, tmp_path_factory):
    a, b = vllm_servers["a"], vllm_servers["b"]
    policy = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "health": {"interval": 1, "backoff_initial": 0.5, "backoff_max": 2},
        "timeouts": {"connect": 2, "read": READ_TIMEOUT},
        "models": [{"name": "duo", "routing": "least-in-flight", "retries": {"migrations": 1},
                    "ejection": {"enabled": False}, "backends": [
                        {"url": a.base_url, "name": "duo-a", "served_name": "tiny-a"},
                        {"url": b.base_url, "name": "duo-b", "served_name": "tiny-b"}]}],
    }
    with gateway_process(policy, tmp_path_factory.mktemp("migrating-gateway")) as gw:
        yield gw


def running_on(servers: list[VLLMServer]) -> VLLMServer | None:
    """The one server with a request running, if exactly one has."""
    busy = [s for s in servers if s.metric("vllm:num_requests_running") > 0]
    return busy[0] if len(busy) == 1 else None


def wait_idle(servers: list[VLLMServer]) -> None:
    """Until no server runs a request (bounded: 30 s): one a stopped server was running when it was resumed
    finishes or is aborted first, so that `running_on` sees only the test's own call."""
    for _ in range(300):
        if all(s.metric("vllm:num_requests_running") == 0 for s in servers):
            return
        time.sleep(0.1)
    pytest.fail("the vLLM servers never went idle")


def stream_chat(client: openai.OpenAI, on_chunk=None) -> tuple[str, set[str], list]:
    stream = client.chat.completions.create(model="duo", messages=PROMPT, max_tokens=MAX, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    parts, ids, chunks = [], set(), []
    for i, chunk in enumerate(stream):
        chunks.append(chunk)
        ids.add(chunk.id)
        parts.extend(c.delta.content or "" for c in chunk.choices)
        if on_chunk is not None:
            on_chunk(i)
    return "".join(parts), ids, chunks


def stream_completion(client: openai.OpenAI, on_chunk=None) -> tuple[str, set[str], list]:
    stream = client.completions.create(model="duo", prompt=PROMPT[0]["content"], max_tokens=MAX, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    parts, ids, chunks = [], set(), []
    for i, chunk in enumerate(stream):
        chunks.append(chunk)
        ids.add(chunk.id)
        parts.extend(c.text or "" for c in chunk.choices)
        if on_chunk is not None:
            on_chunk(i)
    return "".join(parts), ids, chunks


def cut_half_way(client: openai.OpenAI, servers: list[VLLMServer], stream,
                 kill: bool = False) -> tuple[str, str, set[str], list]:
    """(the uninterrupted run's text, then the text, ids and chunks of a run whose replica is stopped at chunk
    CUT), through `stream` (stream_chat or stream_completion). `kill`: SIGKILL instead of SIGSTOP (a crashed
    replica: its connection resets at once), and the server is started again afterwards."""
    references = {stream(client)[0] for _ in range(2)}  # both replicas, at random: the same text
    assert len(references) == 1
    reference = references.pop()
    assert len(reference) > 200
    wait_idle(servers)
    stopped: list[VLLMServer] = []

    def stop_the_server_half_way(i: int) -> None:
        if i == CUT and not stopped:
            server = running_on(servers)
            assert server is not None, "no single server was running the stream"
            stopped.append(server)
            if kill:
                server.kill()  # SIGKILL: the process group is gone, its connections reset
            else:
                server.pause()  # SIGSTOP: its socket stays open and silent, as a hung replica's

    started = time.monotonic()
    try:
        text, ids, chunks = stream(client, stop_the_server_half_way)
    finally:
        for server in stopped:
            if kill:
                server.restart()  # the session's servers serve the tests after this one
            else:
                server.resume()  # SIGCONT, and waits until it answers again
    assert stopped, "the stream ended before it could be cut"
    assert time.monotonic() - started < 90
    return reference, text, ids, chunks


def test_a_completion_stream_cut_half_way_gives_the_text_of_an_uninterrupted_run(migrating, vllm_servers):
    servers = [vllm_servers["a"], vllm_servers["b"]]
    with openai.OpenAI(base_url=f"{migrating.url}/v1", api_key=migrating.key, max_retries=0, timeout=120) as client:
        reference, text, ids, chunks = cut_half_way(client, servers, stream_completion)
    assert text == reference and len(ids) == 1
    assert all((c.model_extra or {}).get("token_ids") is None and (c.model_extra or {}).get("prompt_token_ids")
               is None for chunk in chunks for c in chunk.choices)


def test_a_stream_whose_replica_stops_half_way_gives_the_text_of_an_uninterrupted_run(migrating, vllm_servers):
    servers = [vllm_servers["a"], vllm_servers["b"]]
    moved = migrating.metric("llm_gateway_stream_migrations_total", model="duo", outcome="continued")
    with openai.OpenAI(base_url=f"{migrating.url}/v1", api_key=migrating.key, max_retries=0, timeout=120) as client:
        reference, text, ids, chunks = cut_half_way(client, servers, stream_chat)
    before_cut = "".join(c.delta.content or "" for chunk in chunks[:CUT + 1] for c in chunk.choices)
    assert len(before_cut) > 20 and reference.startswith(before_cut) and text.startswith(before_cut)
    assert len(text) > len(before_cut) + 100  # it went on from the other replica
    assert text == reference  # token-exact: to the last word
    assert len(ids) == 1
    # the token ids the gateway asked for went back to vLLM's null: the client did not ask for them
    assert all((c.model_extra or {}).get("token_ids") is None for chunk in chunks for c in chunk.choices)
    assert all((chunk.model_extra or {}).get("prompt_token_ids") is None for chunk in chunks)
    assert [c.delta.role for chunk in chunks for c in chunk.choices if c.delta.role] == ["assistant"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= MAX  # both replicas' output
    assert migrating.metric("llm_gateway_stream_migrations_total", model="duo", outcome="continued") == moved + 1
    for _ in range(50):  # the access line is written once the call is over, through the log's queue: bounded, 5 s
        if "migrations=1" in migrating.log.read_text():
            break
        time.sleep(0.1)
    assert "migrations=1" in migrating.log.read_text()


def test_a_stream_whose_replica_is_killed_half_way_gives_the_text_of_an_uninterrupted_run(migrating, vllm_servers):
    servers = [vllm_servers["a"], vllm_servers["b"]]
    moved = migrating.metric("llm_gateway_stream_migrations_total", model="duo", outcome="continued")
    with openai.OpenAI(base_url=f"{migrating.url}/v1", api_key=migrating.key, max_retries=0, timeout=120) as client:
        reference, text, ids, chunks = cut_half_way(client, servers, stream_chat, kill=True)
    assert text == reference and len(ids) == 1  # token-exact from the other replica, under one id
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= MAX
    assert migrating.metric("llm_gateway_stream_migrations_total", model="duo", outcome="continued") == moved + 1


def stream_message(client: anthropic.Anthropic, on_chunk=None) -> tuple[str, set[str], list]:
    """(the text, the message ids, the events) of a streamed Messages answer (the anthropic SDK's raw events)."""
    # temperature through extra_body: this SDK's create() no longer names it
    stream = client.messages.create(model="duo", max_tokens=MAX, messages=PROMPT, stream=True,
                                    extra_body={"temperature": 0, "ignore_eos": True})
    parts, ids, events = [], set(), []
    for i, event in enumerate(stream):
        events.append(event)
        if event.type == "message_start":
            ids.add(event.message.id)
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            parts.append(event.delta.text)
        if on_chunk is not None:
            on_chunk(i)
    return "".join(parts), ids, events


def test_a_messages_stream_cut_half_way_is_asked_again_and_the_client_reads_one_stream(migrating, vllm_servers):
    servers = [vllm_servers["a"], vllm_servers["b"]]
    with anthropic.Anthropic(base_url=migrating.url, api_key=migrating.key, max_retries=0, timeout=120) as client:
        reference, text, ids, events = cut_half_way(client, servers, stream_message)
    assert text == reference and len(ids) == 1  # the replay's first part skipped: nothing twice, nothing lost
    kinds = [e.type for e in events]
    assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
    assert kinds.count("message_delta") == 1 and kinds[-1] == "message_stop"
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens >= MAX + CUT // 2  # both replicas' output: the replay made the cut part again


def stream_response(client: openai.OpenAI, on_chunk=None) -> tuple[str, set[str], list]:
    """(the text, the response ids, the events) of a streamed Responses answer (the openai SDK's events)."""
    stream = client.responses.create(model="duo", input=PROMPT[0]["content"], max_output_tokens=MAX, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    parts, ids, events = [], set(), []
    for i, event in enumerate(stream):
        events.append(event)
        if event.type in ("response.created", "response.completed"):
            ids.add(event.response.id)
        elif event.type == "response.output_text.delta":
            parts.append(event.delta)
        if on_chunk is not None:
            on_chunk(i)
    return "".join(parts), ids, events


def test_a_responses_stream_cut_half_way_is_asked_again_and_the_client_reads_one_stream(migrating, vllm_servers):
    servers = [vllm_servers["a"], vllm_servers["b"]]
    moved = migrating.metric("llm_gateway_stream_migrations_total", model="duo", outcome="continued")
    with openai.OpenAI(base_url=f"{migrating.url}/v1", api_key=migrating.key, max_retries=0, timeout=120) as client:
        reference, text, ids, events = cut_half_way(client, servers, stream_response)
    assert text == reference and len(ids) == 1  # the replay's first part skipped, under the first response's id
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1 and kinds.count("response.output_item.added") == 1
    assert kinds.count("response.output_text.done") == 1 and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))  # one sequence, no gap, no repeat
    assert len({e.item_id for e in events if e.type == "response.output_text.delta"}) == 1
    done = events[-1].response
    assert done.output_text == reference
    assert done.usage.output_tokens >= MAX + CUT // 2  # both replicas' output: the replay made the cut part again
    assert migrating.metric("llm_gateway_stream_migrations_total", model="duo", outcome="continued") == moved + 1


def test_a_whole_answer_whose_replica_stops_mid_generation_is_retried_before_its_head(migrating, vllm_servers):
    servers = [vllm_servers["a"], vllm_servers["b"]]
    with openai.OpenAI(base_url=f"{migrating.url}/v1", api_key=migrating.key, max_retries=0, timeout=120) as client:
        def ask():
            return client.chat.completions.with_raw_response.create(
                model="duo", messages=PROMPT, max_tokens=WHOLE_MAX, temperature=0, extra_body={"ignore_eos": True})

        reference = ask().parse().choices[0].message.content
        wait_idle(servers)
        stopped: list[VLLMServer] = []
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask)
            try:
                for _ in range(200):  # bounded: ~10 s for the call to reach a server
                    server = running_on(servers)
                    if server is not None or answer.done():
                        break
                    time.sleep(0.05)
                assert server is not None, "the call never ran on a single server"
                server.pause()
                stopped.append(server)
                raw = answer.result(timeout=90)
            finally:
                for server in stopped:
                    server.resume()
    assert raw.parse().choices[0].message.content == reference
    assert raw.headers["x-gateway-attempts"] == "2"  # the second attempt, on the other replica
