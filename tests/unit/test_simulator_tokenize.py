"""The simulator's token ids mean the same in every process: ids one simulator's /tokenize made read back on
another simulator process's /detokenize, as replicas of one vLLM model share their tokenizer."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tools.simulator.protocol import tokenize
from tools.simulator.vocab import HASHED_FROM, TIERS, detokenize, token_id, token_text
from tests.support.probes import wait_http_ok
from tests.support.servers import free_port, stop_processes

TEXTS = ["hello world", "", "a", "Ünïcödé façade, naïve café", "Привет, мир", "日本語のテキストです",
         "<|im_start|>user\nhi<|im_end|>\n", "\x00\x01 tabs\tand\nnewlines ~~~~"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return [tmp_path_factory.mktemp("sim") / f"sim{i}.log" for i in range(2)]


@pytest.fixture(scope="module")
def two_simulators(logs):
    """Two simulator processes serving one model, each on its own loopback port, logging at info to a file."""
    ports = [free_port(), free_port()]
    procs = []
    try:
        for port, log in zip(ports, logs, strict=True):
            with log.open("w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "tools.simulator", "--port", str(port),
                                               "--model", "m"], stdout=out, stderr=subprocess.STDOUT))
        for port, proc in zip(ports, procs, strict=True):
            wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 60, "a simulator")
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        stop_processes(procs)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_one_process_made_read_back_in_another(two_simulators, text):
    one, other = two_simulators
    made = httpx.post(f"{one}/tokenize", json={"model": "m", "prompt": text}, timeout=10).json()
    assert made["count"] == len(made["tokens"]) == len(tokenize(text))  # one token per 4 characters, as before
    back = httpx.post(f"{other}/detokenize", json={"model": "m", "tokens": made["tokens"]}, timeout=10)
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}
    again = httpx.post(f"{other}/tokenize", json={"model": "m", "prompt": text}, timeout=10).json()
    assert again["tokens"] == made["tokens"]


@pytest.mark.parametrize("tokens", [[-1], [2 ** 63 - 1], [129 * 5], [True], ["abc"], [1.5], "abc"])
def test_ids_it_never_makes_get_a_400(two_simulators, tokens):
    reply = httpx.post(f"{two_simulators[0]}/detokenize", json={"model": "m", "tokens": tokens}, timeout=10)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tokens"


def test_each_piece_has_one_id_and_common_text_keeps_small_ids():
    for piece in ("a", "abcd", "\x00", "é", "ñand", "мир!", "日本", "\u2000", "\ud6ff"):
        tid = token_id(piece)
        assert token_text(tid) == piece
        assert 0 <= tid < HASHED_FROM
    assert token_id("abcd") < 129 ** 4 and token_id("façá") < 2 ** 53  # exact in every JSON reader
    base, start = TIERS[1]
    wider = start + sum((ord(c) + 1) * base ** i for i, c in enumerate("abcd"))
    assert token_text(wider) is None  # "abcd" written in a wider base than its own: not an id it makes
    assert detokenize([]) == "" and detokenize([token_id("ab"), token_id("cd")]) == "abcd"


def test_pieces_beyond_the_written_tiers_get_a_stable_hash_that_reads_back_here():
    piece = "\U0001f600ok"  # an emoji: four characters of this kind hold more than 63 bits
    tid = token_id(piece)
    assert HASHED_FROM <= tid < 2 ** 63
    assert token_text(tid) == piece
    code = f"from tools.simulator.vocab import token_id; print(token_id({piece!r}))"
    elsewhere = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(elsewhere.stdout) == tid  # the same id in another process


def test_health_checks_and_metrics_scrapes_leave_no_access_lines(two_simulators, logs):
    """A gateway probes /health and scrapes /metrics every few seconds; at info the simulator logs other requests
    only."""
    url = two_simulators[0]
    for path in ("/health", "/metrics", "/health?probe=1", "/v1/models"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while '"GET /v1/models' not in logs[0].read_text():  # uvicorn writes the line once the answer is sent
        assert time.monotonic() < deadline, logs[0].read_text()
        time.sleep(0.05)
    lines = logs[0].read_text().splitlines()
    assert not [line for line in lines if "/health" in line or "/metrics" in line], lines
