"""The tracer sets finished calls aside and writes their spans in batches (gateway/tracing/tracer.py): at 64 calls, or
50 ms after the first of a batch, and whatever is left when it closes; each call's spans as if written alone.
Real SDK export to a local receiver that decodes opentelemetry-proto."""

from __future__ import annotations

import asyncio

from backends.replicas import Replica
from gateway.tracing.tracer import WRITE_EVERY, Tracer
from policies.config import Tracing
from policies.metrics import GatewayMetrics
from tests.support.finished_call import Call
from tests.support.otlp_receiver import Receiver

SERVER, CLIENT = 2, 3


def serve(tracer: Tracer, replica: Replica, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        call = Call(f"req-{i}")
        tracer.sending(call, replica)
        call.response = {"id": f"resp-{i}", "model": "m", "choices": [{"finish_reason": "stop"}]}
        call.usage = {"prompt_tokens": i, "completion_tokens": 1}
        tracer.finished(call)


async def test_spans_are_written_every_64_calls_after_50_ms_and_at_close():
    replica = Replica("m-0", "m", "http://127.0.0.1:9", "m", cap=4)
    with Receiver() as receiver:
        tracer = Tracer(Tracing(enabled=True, endpoint=receiver.url, schedule_delay=0.05), GatewayMetrics())
        serve(tracer, replica, WRITE_EVERY - 1)
        assert len(tracer.done) == WRITE_EVERY - 1  # set aside, nothing written yet
        serve(tracer, replica, 1, first=WRITE_EVERY - 1)
        assert not tracer.done  # the 64th call wrote the batch at once
        serve(tracer, replica, 2, first=WRITE_EVERY)
        assert len(tracer.done) == 2
        await asyncio.sleep(0.3)
        assert not tracer.done  # written by the timer, 50 ms after the first
        serve(tracer, replica, 3, first=WRITE_EVERY + 2)
        await asyncio.to_thread(tracer.close)  # as the app closes it: what is left is written and exported
        n = WRITE_EVERY + 5
        roots = receiver.wait_for(lambda s: s.kind == SERVER, count=n)
        upstream = receiver.wait_for(lambda s: s.kind == CLIENT, count=n)
    assert sorted(int(s.attributes["llm_gateway.request_id"][4:]) for s in roots) == list(range(n))
    for root in roots:  # each call's own values, whichever batch it was written in
        i = int(root.attributes["llm_gateway.request_id"][4:])
        assert root.attributes["gen_ai.response.id"] == f"resp-{i}"
        assert root.attributes["gen_ai.usage.input_tokens"] == i
        assert root.attributes["gen_ai.response.finish_reasons"] == ("stop",)
        assert root.attributes["llm_gateway.key_id"] == "key-1" and root.end >= root.start
    by_parent = {s.parent_span_id: s for s in upstream}
    assert all(by_parent[root.span_id].trace_id == root.trace_id for root in roots)
