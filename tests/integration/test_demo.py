"""`llm-gateway demo` (what `make run` starts) serves the openai SDK, and Ctrl-C or SIGTERM stops every process
it started. It shows the product: the console signs in with the token it prints, capped models move the scaling
signal, an adapter and a variant answer, the allow_rented key spills to the rented stand-in under a burst while
the private_only key never does, and `--traffic` fills the usage and own-or-rent figures."""

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.demo import ADAPTER, DATA_POLICIES, DEMO_CAP, RENTED_KEY_ENV, SIMS, demo_policy
from policies.config import Policy
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
    with running_demo() as demo:  # ends it with SIGINT (Ctrl-C) and checks that it exited with status 0
        simulators = children_of(demo.proc.pid)
        assert len(simulators) == len(SIMS)  # two replicas of qwen, two llama variants, the rented stand-in
        client = openai.OpenAI(base_url=f"{demo.base}/v1", api_key=demo.printed["private_only"], max_retries=0)
        assert {m.id for m in client.models.list()} == {"qwen3-4b", "llama-3.1-8b", ADAPTER}
        reply = client.chat.completions.create(model="qwen3-4b", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5)
        assert reply.model == "qwen3-4b" and reply.usage.completion_tokens == 5
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
        assert text
        heard = client.audio.transcriptions.create(model="qwen3-4b", file=("a.wav", b"\0" * 32000, "audio/wav"))
        assert heard.text  # the banner's audio example works against the demo
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{demo.base}/v1", api_key="sk-wrong", max_retries=0).models.list()
    output = "".join(demo.output)
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
        assert len(simulators) == len(SIMS)
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
    with running_demo() as demo:
        base, key = demo.base, demo.printed["private_only"]
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
    output = "".join(demo.output)
    probe_lines = [line for line in output.splitlines()  # (the banner names /metrics, never a GET of it)
                   if "/health" in line or "GET /metrics" in line or "/metrics HTTP" in line]
    assert not probe_lines, output


@dataclass
class Demo:
    proc: subprocess.Popen
    base: str
    printed: dict[str, str]  # the banner's labelled values: console, admin token, one key per data policy
    rented_key: str  # the rented stand-in's key, set through the environment as an operator would
    output: list[str]  # every line the demo printed, read as it comes (so the pipe never fills)

    def auth(self, data_policy: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.printed[data_policy]}"}


LABELS = {"console": "console: ", "admin": "admin token (", "private_only": "private_only key: ",
          "allow_rented": "allow_rented key: "}


def banner_values(lines: list[str]) -> dict[str, str] | None:
    """The banner's labelled values, once all of them are printed."""
    printed = {}
    for line in list(lines):
        text = line.strip()
        for name, label in LABELS.items():
            if text.startswith(label):
                printed[name] = text.rsplit(" ", 1)[1] if name == "admin" else text[len(label):].strip()
    return printed if len(printed) == len(LABELS) else None


@contextmanager
def running_demo(*args: str) -> Iterator[Demo]:
    port = free_port()
    cli = Path(sys.executable).with_name("llm-gateway")
    rented_key = "rk-" + secrets.token_urlsafe(24)
    proc = subprocess.Popen([str(cli), "demo", "--port", str(port), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, RENTED_KEY_ENV: rented_key})
    output: list[str] = []  # every line, read as it comes by a thread of its own (so the pipe never fills)
    reader = threading.Thread(target=lambda: [output.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while (printed := banner_values(output)) is None:  # the banner comes before the gateway starts serving
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the demo's banner lacks a console URL, admin token or key:\n" + "".join(output))
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{base}/ready", proc, 60, "the demo")
        yield Demo(proc, base, printed, rented_key, output)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    reader.join(timeout=10)
    assert proc.returncode == 0, "".join(output)
    assert rented_key not in "".join(output)  # the provider's key is never printed or logged


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    with running_demo() as started:
        yield started


def test_the_demo_policy_validates_with_console_caps_queue_adapter_variants_and_a_rented_provider():
    owners = {owner: [{"name": sim.name, "url": f"http://127.0.0.1:{9000 + i}"}]
              for i, (owner, sim) in enumerate(SIMS)}
    policy = Policy.model_validate(demo_policy("127.0.0.1", 8080, "/tmp/demo-state", owners))
    assert policy.console.enabled and policy.console.secure_cookie  # loopback: a browser keeps a Secure cookie
    qwen, llama = policy.models
    assert all(b.cap for m in policy.models for b in m.backends) and qwen.queue.max_depth > 0
    assert [a.name for a in qwen.lora.adapters] == [ADAPTER]
    assert {v.name: v.weight for v in llama.variants} == {"baseline": 90, "canary": 10}
    [provider] = policy.providers
    assert qwen.overflow.provider == provider.name and provider.allow_private_address
    assert provider.api_key_env == RENTED_KEY_ENV
    wide = Policy.model_validate(demo_policy("0.0.0.0", 8080, "/tmp/demo-state", owners))
    assert not wide.console.secure_cookie  # plain HTTP off loopback: a Secure cookie would be dropped


def test_the_console_signs_in_with_the_printed_admin_token(demo):
    assert demo.printed["console"] == f"{demo.base}/console"
    with httpx.Client(base_url=demo.base, timeout=30) as http:
        form = http.get("/console/signin")
        assert form.status_code == 200
        nonce = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
        http.cookies.set("console_signin", nonce)  # httpx keeps no Secure cookie over http://; a browser does
        signed = http.post("/console/signin", data={"csrf": nonce, "token": demo.printed["admin"]})
        assert signed.status_code == 303, signed.text[:500]
        cookie = next(c for c in signed.headers.get_list("set-cookie") if c.startswith("console_session="))
        http.cookies.set("console_session", cookie.split(";")[0].split("=", 1)[1])
        landing = http.get(signed.headers["location"])
        assert landing.status_code == 200 and "Sign in" not in landing.text.split("<title>")[1][:40]
        for path in ("fleet", "usage", "report", "variants", "keys"):
            assert http.get(f"/console/{path}").status_code == 200, path


def test_scaling_lists_the_capped_models(demo):
    figures = httpx.get(f"{demo.base}/scaling", timeout=10).json()["models"]
    assert set(figures) == {"qwen3-4b", "llama-3.1-8b#baseline", "llama-3.1-8b#canary"}
    assert all(f["cap"] == DEMO_CAP for f in figures.values())
    assert figures["qwen3-4b"]["replicas"] == 2


def test_the_adapter_and_both_variants_answer(demo):
    with httpx.Client(base_url=demo.base, headers=demo.auth("private_only"), timeout=30) as http:
        body = {"model": ADAPTER, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200 and reply.json()["model"] == ADAPTER, reply.text
        seen = set()
        for _ in range(60):  # the canary's 10 %, spread evenly: a few in every 20 calls
            reply = http.post("/v1/chat/completions", json={**body, "model": "llama-3.1-8b", "max_tokens": 1})
            assert reply.status_code == 200, reply.text
            seen.add(reply.headers["x-gateway-variant"])
            if seen == {"baseline", "canary"}:
                break
        assert seen == {"baseline", "canary"}


def stand_in(demo: Demo) -> str:
    """The rented stand-in's address: the demo's child simulator serving the provider's model name."""
    [pid] = [p for p in children_of(demo.proc.pid) if "rented/" in Path(f"/proc/{p}/cmdline").read_text()]
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"


def rented_served(demo: Demo) -> tuple[float, float]:
    """The rented stand-in's own count of requests it served, and the gateway's count of rented answers."""
    own = httpx.get(f"{stand_in(demo)}/metrics", timeout=10).text
    gateway = httpx.get(f"{demo.base}/metrics", timeout=10).text
    return (sum(float(line.rsplit(" ", 1)[1]) for line in own.splitlines()
                if line.startswith("vllm:request_success_total")),
            sum(float(line.rsplit(" ", 1)[1]) for line in gateway.splitlines()
                if line.startswith("llm_gateway_served_requests_total") and 'served_by="rented"' in line))


def test_a_burst_spills_only_the_allow_rented_key_to_the_rented_stand_in(demo):
    models = f"{stand_in(demo)}/v1/models"
    assert httpx.get(models, timeout=10).status_code == 401  # it checks the key the demo gave it
    ok = httpx.get(models, headers={"Authorization": f"Bearer {demo.rented_key}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "rented/qwen3-4b"
    before = rented_served(demo)
    body = {"model": "qwen3-4b", "max_tokens": 64, "ignore_eos": True, "messages": [{"role": "user", "content": "x"}]}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=demo.base, timeout=120,
                                     limits=httpx.Limits(max_connections=40)) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body,
                                                    headers=demo.auth(DATA_POLICIES[i % 2]))
                                          for i in range(24)))  # 12 per key: three times the two replicas' caps

    replies = asyncio.run(burst())
    assert [r.status_code for r in replies] == [200] * 24, [r.text[:200] for r in replies if r.status_code != 200]
    private = [r.headers["x-gateway-served-by"] for r in replies[0::2]]
    renter = [r.headers["x-gateway-served-by"] for r in replies[1::2]]
    assert private == ["owned"] * 12  # the private_only key waited in the queue instead
    assert "rented" in renter
    after = rented_served(demo)
    spilled = renter.count("rented")
    assert after[0] - before[0] == spilled and after[1] - before[1] == spilled  # the stand-in served exactly those
    needed = httpx.get(f"{demo.base}/scaling?model=qwen3-4b", timeout=10).json()
    assert needed["needed"] >= 2, needed  # the burst asked for more replicas than the two there are


def test_traffic_fills_usage_and_own_or_rent_within_a_minute():
    with running_demo("--traffic") as started, httpx.Client(
            base_url=started.base, timeout=30, headers={"Authorization": f"Bearer {started.printed['admin']}"}) as http:
        deadline = time.monotonic() + 120
        while True:
            report = http.get("/admin/report", params={"window": 600}).json()
            qwen = report["models"].get("qwen3-4b")
            keys = report["keys"].values()
            if (qwen and qwen["rented"]["requests"] > 0 and qwen["owned"]["requests"] > 0
                    and sum(k["tokens"] for k in keys) > 0 and any(k["rented_requests"] > 0 for k in keys)
                    and ADAPTER in report["models"] and "llama-3.1-8b" in report["models"]):
                break
            assert time.monotonic() < deadline, report
            time.sleep(1)
        assert qwen["rented"]["cost"] > 0 and qwen["owned_cost"] > 0  # both sides of own-or-rent are priced
