"""The observers of finished calls (policies/finished.py): every call, answered, streamed or refused, is published
once as one record, its tokens as the backend reported them; an observer that raises neither breaks the
response nor keeps the others from their record, and is logged and counted."""

import logging

import httpx

from tools.simulator import SimConfig, create_app
from policies.finished import Finished, Observers
from tests.support.gateway import AUTH, one_model, running_gateway
from tests.support.probes import eventually
from tests.support.servers import serve_app

SIM = SimConfig(model="served-m", step_base_ms=1, step_ms_per_seq=0)
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}


class Kept:
    name = "kept"

    def __init__(self) -> None:
        self.records: list[Finished] = []

    def observe(self, record: Finished) -> None:
        self.records.append(record)

    async def has(self, count: int) -> bool:
        return len(self.records) == count


class Broken:
    name = "broken"

    def observe(self, record: Finished) -> None:
        raise RuntimeError("an observer's bug")


def add(gw, *observers) -> None:
    proxy = gw.state.proxy
    proxy.observers = Observers([*observers, *proxy.observers], gw.state.metrics.observer_failed)


async def test_each_call_is_one_record_with_the_tokens_the_backend_reported():
    async with serve_app(create_app(SIM)) as sim, running_gateway(one_model(sim)) as gw, \
            httpx.AsyncClient(timeout=20, headers=AUTH) as http:
        kept = Kept()
        add(gw, kept)
        r = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
        assert r.status_code == 200
        usage = r.json()["usage"]
        async with http.stream("POST", f"{gw.url}/v1/chat/completions", json={**BODY, "stream": True}) as s:
            assert s.status_code == 200
            _ = [line async for line in s.aiter_lines()]
        refused = await http.post(f"{gw.url}/v1/chat/completions", json={**BODY, "model": "nope"})
        assert refused.status_code == 404
        await eventually(lambda: kept.has(3), timeout=10)

        plain, streamed, unknown = kept.records
        assert (plain.model, plain.status, plain.served_by, plain.stream) == ("m", 200, "owned", False)
        assert (plain.prompt_tokens, plain.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert plain.replica is not None and plain.replica.name == "m-0" and plain.sent_at > 0
        assert plain.request_id == r.headers["x-request-id"] and plain.key_id is not None
        assert (streamed.stream, streamed.status, streamed.completion_tokens) == (True, 200, 5)
        assert (unknown.model, unknown.status, unknown.replica, unknown.served_by) == ("", 404, None, None)
        assert await gw.metric("llm_gateway_requests_total", model="m", status="200") == 2
        assert await gw.metric("llm_gateway_observer_errors_total") == 0


async def test_an_observer_that_raises_breaks_no_response_and_no_other_observer(caplog):
    async with serve_app(create_app(SIM)) as sim, running_gateway(one_model(sim)) as gw, \
            httpx.AsyncClient(timeout=20, headers=AUTH) as http:
        kept = Kept()
        add(gw, Broken(), kept)
        with caplog.at_level(logging.INFO):
            r = await http.post(f"{gw.url}/v1/chat/completions", json=BODY)
            assert r.status_code == 200 and r.json()["choices"]
            async with http.stream("POST", f"{gw.url}/v1/chat/completions", json={**BODY, "stream": True}) as s:
                lines = [line async for line in s.aiter_lines()]
            assert s.status_code == 200 and "data: [DONE]" in lines
            models = await http.get(f"{gw.url}/v1/models")  # answered by the gateway itself
            assert models.status_code == 200
            await eventually(lambda: kept.has(3), timeout=10)

        assert await gw.metric("llm_gateway_observer_errors_total", observer="broken") == 3
        assert [r.endpoint for r in kept.records] == ["chat/completions", "chat/completions", "models"]
        assert await gw.metric("llm_gateway_requests_total", model="m", status="200") == 2  # metrics still ran
        failed = [r for r in caplog.records if r.name == "gateway.observers"]
        assert len(failed) == 3 and "observer broken failed" in failed[0].getMessage()
        access = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
        assert len(access) == 3  # the access log still wrote every line
