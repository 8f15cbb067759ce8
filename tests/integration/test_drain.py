"""A rolling update's SIGTERM, with real processes: `llm-gateway serve` over the simulator, under streaming load.

What must hold (gateway/http/server.py): /ready answers 503 within a second of SIGTERM while /health stays 200;
every request sent during the drain window is served; every stream in flight when SIGTERM came ends with
[DONE]; then the process exits by itself (0), having flushed its access log and the usage counters.

Bounds are generous except the issue's "within 1 s", which is polled: this machine is small and shared.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.store import open_store
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port

CLI = str(Path(sys.executable).with_name("llm-gateway"))
DRAIN = 5.0  # server.drain_seconds
SHUTDOWN_TIMEOUT = 60.0  # server.shutdown_timeout: far above what the streams need
SEND_MARGIN = 1.5  # drain-window senders stop this long before the drain ends, for a loaded event loop
STREAM_TOKENS = 400  # at 20 ms a token: ~8 s, so the streams outlive the drain and the listener's close
IN_FLIGHT = 4


def chat(stream: bool, max_tokens: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    return body


def read_stream(client: httpx.Client, url: str, headers: dict, max_tokens: int,
                first_chunk: threading.Event | None = None) -> list[str]:
    """The SSE data lines of one streamed chat completion."""
    lines = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=chat(True, max_tokens), headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if first_chunk is not None:
                    first_chunk.set()
    return lines


def test_sigterm_drains_then_exits(tmp_path):
    secret = secrets.token_urlsafe(32)
    env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    sim_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    db = tmp_path / "keys.db"
    config = tmp_path / "policy.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "server": {"drain_seconds": DRAIN, "shutdown_timeout": SHUTDOWN_TIMEOUT},
        "store": {"kind": "sqlite", "path": str(db)},
        "health": {"interval": 0.5},
        "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{sim_port}"}]}],
    }))
    sim = subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(sim_port), "--model", "m",
                            "--log-level", "warning", "--step-base-ms", "20", "--step-ms-per-seq", "0",
                            "--max-num-seqs", "64"])
    stop_sending = threading.Event()  # ends the drain-window senders, also when an assertion fails first
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        gateway = subprocess.Popen([CLI, "serve", "--config", str(config)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"{url}/ready", gateway, 60, "the gateway")
        token = mint_token(Admin(), 600, secret=secret)
        r = httpx.post(f"{url}/admin/keys", json={"name": "drain"}, headers={"authorization": f"Bearer {token}"},
                       timeout=30)
        r.raise_for_status()
        key, key_id = r.json()["key"], r.json()["record"]["id"]
        auth = {"authorization": f"Bearer {key}"}

        # Streams in flight when SIGTERM comes: each has its first chunk before the signal is sent.
        streams: list[list[str] | BaseException] = [[] for _ in range(IN_FLIGHT)]
        started = [threading.Event() for _ in range(IN_FLIGHT)]

        def run_stream(i: int) -> None:
            try:
                with httpx.Client(timeout=120) as client:
                    streams[i] = read_stream(client, url, auth, STREAM_TOKENS, started[i])
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                streams[i] = exc
                started[i].set()

        stream_threads = [threading.Thread(target=run_stream, args=(i,), daemon=True) for i in range(IN_FLIGHT)]
        for t in stream_threads:
            t.start()
        for event in started:
            assert event.wait(60), "a stream sent no first chunk"

        # Requests sent during the drain window, streamed and not, from keep-alive clients.
        sent: list[tuple[float, str]] = []  # (seconds after SIGTERM, outcome)

        def send_loop(streaming: bool) -> None:
            with httpx.Client(timeout=60) as client:
                while not stop_sending.is_set():
                    at = time.monotonic() - signalled
                    try:
                        if streaming:
                            lines = read_stream(client, url, auth, 8)
                            outcome = "ok" if lines and lines[-1] == "[DONE]" else f"no [DONE]: {lines[-2:]}"
                        else:
                            r = client.post(f"{url}/v1/chat/completions", json=chat(False, 8), headers=auth)
                            ok = r.status_code == 200 and r.json()["choices"]
                            outcome = "ok" if ok else f"{r.status_code} {r.text[:200]}"
                    except httpx.HTTPError as exc:
                        outcome = f"{type(exc).__name__}: {exc}"
                        time.sleep(0.05)  # a refused connection fails fast: do not spin
                    sent.append((at, outcome))

        gateway.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        senders = [threading.Thread(target=send_loop, args=(s,), daemon=True) for s in (False, True, False)]
        for t in senders:
            t.start()

        # /ready: 503 within a second, with a body that says why; /health stays 200.
        ready_status, ready_body, waited = None, None, 0.0
        with httpx.Client(timeout=5) as probe:
            while time.monotonic() - signalled < 5:
                try:
                    r = probe.get(f"{url}/ready")
                except httpx.HTTPError as exc:
                    raise AssertionError(f"/ready failed after SIGTERM instead of answering 503: {exc!r}") from exc
                waited = time.monotonic() - signalled
                if r.status_code == 503:
                    ready_status, ready_body = r.status_code, r.json()
                    break
                time.sleep(0.02)
            assert ready_status == 503, "/ready never answered 503 after SIGTERM"
            assert waited <= 1.0, f"/ready answered 503 only {waited:.2f} s after SIGTERM"
            assert ready_body["status"] == "draining"
            health = probe.get(f"{url}/health")
            assert health.status_code == 200, health.text
            assert health.headers.get("connection") == "close"  # keep-alive clients move to another replica

        time.sleep(max(0.0, DRAIN - SEND_MARGIN - (time.monotonic() - signalled)))
        stop_sending.set()
        for t in senders:
            t.join(90)
        failed = [(round(at, 2), outcome) for at, outcome in sent if outcome != "ok"]
        assert len(sent) >= 3, sent
        assert not failed, f"{len(failed)} of {len(sent)} requests sent during the drain failed: {failed[:5]}"

        # After the drain the listener closes while the streams still run; each one ends with [DONE].
        for t in stream_threads:
            t.join(SHUTDOWN_TIMEOUT + 30)
        for i, lines in enumerate(streams):
            assert not isinstance(lines, BaseException), f"stream {i} failed: {lines!r}"
            assert lines and lines[-1] == "[DONE]", f"stream {i} ended with {lines[-2:]}"
        exit_code = gateway.wait(SHUTDOWN_TIMEOUT + 30)
        exited = time.monotonic() - signalled
        assert exit_code == 0, log_path.read_text()[-3000:]
        assert exited >= DRAIN - 0.5, f"exited {exited:.1f} s after SIGTERM, before the drain was over"
    finally:
        stop_sending.set()
        for proc in (gateway, sim):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    # The lifespan's shutdown ran: the access log names every request, the usage counters hold them all.
    text = log_path.read_text()
    assert "SIGTERM: draining" in text, text[-3000:]
    assert key not in text and secret not in text
    served = IN_FLIGHT + len(sent)
    assert text.count("endpoint=chat/completions") == served, text[-3000:]

    async def usage() -> dict:
        store = open_store("sqlite", path=str(db))
        try:
            return await store.usage(key_id)
        finally:
            await store.close()

    totals = asyncio.run(usage())
    assert sum(per_model["requests"] for per_model in totals.values()) == served, totals
