"""Hostile clients against a real `llm-gateway serve` process (gateway/http/edge.py): the door stays up.

The gateway runs over the vLLM simulator with short edge timeouts (header 1.5 s, body 2 s, keep-alive 3 s) and
its file limit lowered to 256, so that `server.max_connections` (4096 by default) is cut to (256 - 64) / 2 = 96
without opening tens of thousands of sockets. Every case checks its own answer (status, the route's error shape,
how soon) and that a well-behaved client keeps getting answers: each of its calls within GOOD_BOUND seconds,
however many hostile connections are open. Bounds are loose: this machine is small and shared.
"""

from __future__ import annotations

import os
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from gateway.admin.auth import mint_token
from policies.config import Admin, Server
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port, stop_processes

CLI = str(Path(sys.executable).with_name("llm-gateway"))
NOFILE = 256
CONNECTION_BOUND = (NOFILE - 64) // 2
HEADER_TIMEOUT, BODY_TIMEOUT, KEEPALIVE = 1.5, 2.0, 3.0
GOOD_BOUND = 5.0  # seconds: the well-behaved client's every call, whatever else is going on


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else -1


def body_of(raw: bytes) -> dict:
    return orjson.loads(raw.split(b"\r\n\r\n", 1)[1])


def header_of(raw: bytes, name: bytes) -> bytes | None:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


def read_answer(sock: socket.socket, timeout: float) -> bytes:
    """Whatever the server sends until it closes (or `timeout`); b"" when it closed without a word."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return got


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def lower_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


class Gateway:
    def __init__(self, tmp: Path, server: dict, nofile: bool) -> None:
        self.secret = secrets.token_urlsafe(32)
        self.port, self.sim_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"gateway-{self.port}.log"
        policy = tmp / f"policy-{self.port}.yaml"
        policy.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": self.port},
            "server": server,
            "store": {"kind": "sqlite", "path": str(tmp / f"keys-{self.port}.db")},
            "health": {"interval": 0.5},
            "models": [{"name": "m", "backends": [{"url": f"http://127.0.0.1:{self.sim_port}"}]}],
        }))
        self.sim = subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(self.sim_port),
                                     "--model", "m", "--log-level", "warning", "--step-base-ms", "20",
                                     "--step-ms-per-seq", "0", "--max-num-seqs", "256"])
        env = {**os.environ, "LLM_GATEWAY_ADMIN_SECRET": self.secret, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([CLI, "serve", "--config", str(policy)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=lower_file_limit if nofile else None)
        wait_http_ok(f"{self.url}/ready", self.proc, 60, "the gateway")
        token = mint_token(Admin(), 600, secret=self.secret)
        r = httpx.post(f"{self.url}/admin/keys", json={"name": "hostile"},
                       headers={"authorization": f"Bearer {token}"}, timeout=30)
        r.raise_for_status()
        self.key = r.json()["key"]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def good_call(self) -> float:
        """One chat completion as an app sends it; returns how long it took (asserting it worked)."""
        t0 = time.monotonic()
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=30,
                       headers={"authorization": f"Bearer {self.key}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    def stop(self) -> None:
        stop_processes([self.proc, self.sim])


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = Gateway(tmp_path_factory.mktemp("hostile"), {"header_timeout": HEADER_TIMEOUT, "body_timeout": BODY_TIMEOUT,
                                                     "keepalive_seconds": KEEPALIVE}, nofile=True)
    yield g
    g.stop()
    log = g.log.read_text(errors="replace")
    assert g.key not in log and g.key[:20] not in log, "an API key reached the gateway's log"
    assert "Traceback" not in log, log[-3000:]


class GoodClient:
    """Calls the gateway in a loop in a thread, recording each call's time, while a hostile case runs."""

    def __init__(self, gw: Gateway) -> None:
        self.gw, self.times, self.errors = gw, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        for _ in range(1000):  # bounded; the case ends it much sooner
            if self.stop.is_set():
                return
            try:
                self.times.append(self.gw.good_call())
            except Exception as exc:  # noqa: BLE001 - asserted by the case
                self.errors.append(repr(exc))
            time.sleep(0.05)

    def __enter__(self) -> GoodClient:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.errors, self.errors[:3]
        assert self.times, "the good client made no call"
        assert max(self.times) < GOOD_BOUND, f"a good call took {max(self.times):.1f} s"


def test_defaults_are_the_documented_ones():
    s = Server()
    assert (s.max_header_bytes, s.header_timeout, s.body_timeout, s.body_min_rate, s.keepalive_seconds,
            s.max_connections) == (65536, 30.0, 60.0, 1024, 90.0, 4096)
    assert s.keepalive_seconds > 75, "keep-alive must outlast the load balancers in front (ALB 60 s, nginx 75 s)"


def test_an_oversized_head_is_a_fast_431_in_the_routes_shape_and_memory_stays_put(gw):
    base_hwm = memory_kib(gw.proc.pid, "VmHWM")
    with GoodClient(gw):
        for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
            s = gw.connect()
            t0 = time.monotonic()
            s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {gw.key}\r\nx-big: ".encode()
                      + b"a" * (1 << 20) + b"\r\n\r\n")
            raw = read_answer(s, 10)
            s.close()
            assert status_of(raw) == 431, raw[:200]
            assert time.monotonic() - t0 < 3
            body = body_of(raw)
            if shape == "openai":
                assert body["error"]["code"] == "request_header_fields_too_large"
                assert "server.max_header_bytes" in body["error"]["message"]
            else:
                assert body["type"] == "error" and "server.max_header_bytes" in body["error"]["message"]
            assert gw.key.encode() not in raw
        # 20 MiB of one header, sent as fast as the socket takes it: cut at 64 KiB, the rest dropped unparsed
        for _ in range(3):
            s = gw.connect()
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nx-huge: " + b"b" * (20 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the gateway closed after answering: what it may do
            s.close()
    grown_mib = (memory_kib(gw.proc.pid, "VmHWM") - base_hwm) / 1024
    assert grown_mib < 32, f"peak memory grew {grown_mib:.0f} MiB for oversized heads"


def test_slowloris_heads_get_408_within_the_header_timeout(gw):
    with GoodClient(gw):
        socks = [gw.connect() for _ in range(20)]
        t0 = time.monotonic()
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        deadline = t0 + 15
        for _ in range(40):  # a byte of one more header every 0.2 s, never the blank line that ends the head
            if time.monotonic() > deadline:
                break
            try:
                for s in socks:
                    s.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.2)
        answers = [read_answer(s, 10) for s in socks]
        took = time.monotonic() - t0
        for s in socks:
            s.close()
    assert all(status_of(a) == 408 for a in answers), [a[:80] for a in answers]
    assert "server.header_timeout" in body_of(answers[0])["error"]["message"]
    assert took < HEADER_TIMEOUT + 8


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(gw):
    s = gw.connect()
    t0 = time.monotonic()
    raw = read_answer(s, 15)
    s.close()
    assert status_of(raw) == 408
    assert HEADER_TIMEOUT * 0.8 < time.monotonic() - t0 < HEADER_TIMEOUT + 8


def test_a_stalled_or_dripping_body_is_cut(gw):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {gw.key}\r\n"
            f"content-type: application/json\r\ncontent-length: 4000\r\n\r\n").encode()
    with GoodClient(gw):
        stalled, drip = gw.connect(), gw.connect()
        t0 = time.monotonic()
        stalled.sendall(head + b'{"model": "m", ')
        drip.sendall(head)
        cut = None
        for _ in range(60):  # one byte every 0.25 s (4 bytes/s, under the 1 KiB/s floor), at most 15 s
            try:
                drip.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                cut = time.monotonic() - t0
                break
            time.sleep(0.25)
        answers = {name: read_answer(s, 15) for name, s in (("stalled", stalled), ("drip", drip))}
        stalled.close()
        drip.close()
    assert status_of(answers["stalled"]) == 408, answers["stalled"][:200]
    assert "server.body_timeout" in body_of(answers["stalled"])["error"]["message"]
    assert status_of(answers["drip"]) == 408, answers["drip"][:200]
    assert "server.body_min_rate" in body_of(answers["drip"])["error"]["message"]
    assert cut is None or cut < 5 + 8


def test_idle_connections_past_the_file_limit_make_room_and_leak_nothing(gw):
    fds_before = open_fds(gw.proc.pid)
    with GoodClient(gw) as good:
        socks = [gw.connect() for _ in range(CONNECTION_BOUND + 60)]  # more than the bound the file limit sets
        assert open_fds(gw.proc.pid) < NOFILE
        for _ in range(5):
            assert gw.good_call() < GOOD_BOUND
        assert len(good.times) >= 1
    # the oldest idle connections made room: the server closed them without a word
    closed = 0
    for s in socks[:50]:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionResetError:
            closed += 1
    assert closed >= 30, f"only {closed} of the 50 oldest idle connections were closed to make room"
    for s in socks:
        s.close()
    deadline = time.monotonic() + HEADER_TIMEOUT + 15
    while open_fds(gw.proc.pid) > fds_before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_fds(gw.proc.pid) <= fds_before + 4, "connections left open after their clients went"


def test_keep_alive_outlasts_a_short_pause_and_ends_at_its_setting(gw):
    with httpx.Client(timeout=10) as client:
        r1 = client.get(f"{gw.url}/health")
        time.sleep(KEEPALIVE / 2)
        r2 = client.get(f"{gw.url}/health")  # same pooled connection, still open
        assert r1.status_code == r2.status_code == 200
    s = gw.connect()
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    t0 = time.monotonic()
    raw = read_answer(s, KEEPALIVE + 10)  # read until the server closes the idle connection
    s.close()
    assert status_of(raw) == 200
    assert KEEPALIVE * 0.8 < time.monotonic() - t0 < KEEPALIVE + 8


def test_when_every_connection_serves_a_request_a_new_one_gets_a_fast_503(tmp_path):
    g = Gateway(tmp_path, {"max_connections": 4}, nofile=False)
    try:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
                             "ignore_eos": True, "stream": True})
        busy = []
        for _ in range(4):  # four streams of ~6 s (20 ms a token) hold every connection the gateway allows
            s = g.connect()
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {g.key}\r\n"
                      f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            s.settimeout(20)
            assert s.recv(100).startswith(b"HTTP/1.1 200"), "a stream did not start"
            busy.append(s)
        t0 = time.monotonic()
        s = g.connect()
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        raw = read_answer(s, 10)
        s.close()
        assert status_of(raw) == 503, raw[:200]
        assert header_of(raw, b"retry-after") == b"1"
        assert body_of(raw)["error"]["code"] == "too_many_connections"
        assert time.monotonic() - t0 < 3
        for s in busy:
            s.close()
        deadline = time.monotonic() + 20  # the streams' connections gone, a call goes through again
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{g.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert g.good_call() < GOOD_BOUND
    finally:
        g.stop()
