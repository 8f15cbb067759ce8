"""What one traced call costs the gateway's process, alone: CPU per call for the tracer's whole part of it
(`sending`, `finished`, writing the spans, the export thread's HTTP export to a local sink), against tracing
off in the same run. A diagnostic for gateway/tracing/tracer.py and gateway/tracing/spans.py; the figure that counts is
requests/s with and without tracing, `python -m tests.benchmarks.peers.run --tracing-compare`.

    python -m tests.benchmarks.tracing_call [--calls 20000]

Calls are the shape of the benchmark's non-streaming chat call (one upstream attempt, usage, one choice), each
with its own request and response id, run on an event loop as the gateway runs them. The figures are process
CPU (every thread), so the export thread counts; on a loaded machine they rise, but both modes rise alike.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

import httpx

from backends.replicas import Replica
from gateway.tracing import tracing_for
from policies.config import Tracing
from policies.metrics import GatewayMetrics
from tests.support.finished_call import Call
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port


async def run(tracing: Any, calls: int) -> float:
    """CPU microseconds per call, spans exported included."""
    replica = Replica("m-0", "m", "http://127.0.0.1:8000", "m", cap=64)
    replica.in_flight = 17

    def one(i: int) -> None:
        call = Call(f"req-{i:012x}", arrived=time.perf_counter())
        tracing.sending(call, replica)
        call.response = {"id": f"chatcmpl-{i:012x}", "model": "m",
                         "choices": [{"index": 0, "finish_reason": "stop"}]}
        call.usage = {"prompt_tokens": 12, "completion_tokens": 9}
        tracing.finished(call)

    for i in range(2000):  # caches and the export thread warm
        one(i)
    started = time.process_time()
    for i in range(calls):
        one(i)
    if tracing.enabled:
        tracing.write()
        tracing.pipe.processor.force_flush()  # on this thread: exported when it returns
    return (time.process_time() - started) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20_000)
    args = p.parse_args()
    port = free_port()
    sink = subprocess.Popen([sys.executable, "-m", "tests.benchmarks.peers.otlp_sink", str(port)])
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/", sink, 30, "the OTLP sink")
        off = asyncio.run(run(tracing_for(Tracing(), GatewayMetrics()), args.calls))
        config = Tracing(enabled=True, endpoint=f"http://127.0.0.1:{port}/v1/traces", sampling_ratio=1.0,
                         max_queue_size=100_000)
        tracer = tracing_for(config, GatewayMetrics())
        on = asyncio.run(run(tracer, args.calls))
        got = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).json()
        tracer.close()
    finally:
        sink.kill()
        sink.wait(10)
    print(f"tracing off: {off:.1f} us of CPU per call; on, ratio 1.0: {on:.1f} us; tracing's part: {on - off:.1f} us"
          f" per call ({got['bytes'] / (args.calls + 2000):,.0f} bytes of spans per call exported)")


if __name__ == "__main__":
    main()
