"""`llm-gateway demo` (what `make run` starts) serves the openai SDK, and Ctrl-C or SIGTERM stops every process
it started."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.probes import wait_http_ok
from tests.support.servers import free_port


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_demo_serves_and_ctrl_c_stops_everything():
    port = free_port()
    cli = Path(sys.executable).with_name("llm-gateway")
    proc = subprocess.Popen([str(cli), "demo", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    seen = []
    try:
        for line in proc.stdout:  # the banner comes before the gateway starts serving
            seen.append(line)
            if line.strip().startswith("API key: "):
                key = line.split("API key: ")[1].strip()
                break
        else:
            raise AssertionError("the demo printed no API key:\n" + "".join(seen))
        wait_http_ok(f"{base}/ready", proc, 30, "the demo")
        simulators = children_of(proc.pid)
        assert len(simulators) == 3  # two replicas of one model, one of the other

        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        assert {m.id for m in client.models.list()} == {"qwen3-4b", "llama-3.1-8b"}
        reply = client.chat.completions.create(model="qwen3-4b", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5)
        assert reply.model == "qwen3-4b" and reply.usage.completion_tokens == 5
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
        assert text
        heard = client.audio.transcriptions.create(model="qwen3-4b", file=("a.wav", b"\0" * 32000, "audio/wav"))
        assert heard.text  # the banner's audio example works against the demo
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        output = proc.stdout.read()  # not communicate(): it would skip what the line reader buffered
    assert proc.returncode == 0, output
    output = "".join(seen) + output
    for expected in ("curl", "OpenAI(base_url", "admin token", "/v1/responses", "/v1/audio/transcriptions"):
        assert expected in output, output
    for pid in simulators:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigterm_stops_the_demo_and_its_simulators():
    port = free_port()
    cli = Path(sys.executable).with_name("llm-gateway")
    proc = subprocess.Popen([str(cli), "demo", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", proc, 30, "the demo")
        simulators = children_of(proc.pid)
        assert len(simulators) == 3
    finally:
        proc.send_signal(signal.SIGTERM)  # as `kill`, systemd or a container runtime stop it
        proc.wait(timeout=30)
    left = [pid for pid in simulators if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
    for pid in left:  # the test's own clean-up of what the demo failed to stop
        os.kill(pid, signal.SIGKILL)
    assert not left, "simulators left running under init"  # reaped by the demo instead
    assert proc.returncode == 0


def test_demo_tokenize_round_trips_across_replicas_and_logs_no_probe_lines():
    """/tokenize then /detokenize on the two-replica model land on either replica; each answers 200 with the text
    back. Over several health-check rounds the demo prints no line for a probe that passed."""
    port = free_port()
    cli = Path(sys.executable).with_name("llm-gateway")
    proc = subprocess.Popen([str(cli), "demo", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.strip().startswith("API key: "):
                key = line.split("API key: ")[1].strip()
                break
        else:
            raise AssertionError("the demo printed no API key:\n" + "".join(seen))
        wait_http_ok(f"{base}/ready", proc, 30, "the demo")
        started = time.monotonic()
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=auth, timeout=30) as http:
            for i in range(20):
                text = f"round trip number {i}: Grüße, мир"
                made = http.post("/tokenize", json={"model": "qwen3-4b", "prompt": text})
                assert made.status_code == 200, made.text
                back = http.post("/detokenize", json={"model": "qwen3-4b", "tokens": made.json()["tokens"]})
                assert back.status_code == 200, (i, back.text)
                assert back.json()["prompt"] == text
        # the demo checks its backends every 2 s: let at least three rounds run before looking at the output
        time.sleep(max(0.0, 3 * 2 + 1 - (time.monotonic() - started)))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        output = proc.stdout.read()
    assert proc.returncode == 0, output
    output = "".join(seen) + output
    probe_lines = [line for line in output.splitlines()  # (the banner names /metrics, never a GET of it)
                   if "/health" in line or "GET /metrics" in line or "/metrics HTTP" in line]
    assert not probe_lines, output
