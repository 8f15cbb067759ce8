"""Work moved off the request path: usage summed and written in batches, access-log lines written in batches."""

from __future__ import annotations

import asyncio
import io
import logging
import time

import pytest

from gateway.access_log import AccessLog
from gateway import background as background_module
from gateway.background import Background
from policies import accounting
from backends.replicas import Replica
from policies.accounting import RecordUsage, by_model
from policies.config import Ledger
from policies.finished import Finished
from policies.ledger import record
from policies.ledger.record import RecordLedger
from policies.ledger.sqlite import SQLiteLedger
from policies.ledger.sums import REQUESTS
from policies.store import StoreUnavailable


class FlakyStore:
    def __init__(self) -> None:
        self.writes: list[tuple] = []
        self.down = False

    async def add_usage(self, key_id, model, *, requests, prompt_tokens, completion_tokens, rented=False):
        if self.down:
            raise ConnectionError("store down")
        self.writes.append((key_id, model, requests, prompt_tokens, completion_tokens, rented))


def finished(key: str | None, model: str, prompt: int = 0, completion: int = 0, rented: str | None = None,
             variant=None, backend: str | None = "gpu-0", sent_ago: float = 0.01) -> Finished:
    """The record of a finished call (policies/finished.py), sent `sent_ago` seconds before it ended."""
    now = time.perf_counter()
    replica = None if backend is None else Replica(backend, model, "http://127.0.0.1:1", model, rented=rented,
                                                   variant=variant)
    return Finished(f"req-{now}", "chat/completions", model, replica.group if replica else model, variant, key,
                    replica, ("rented" if rented else "owned") if replica else None, 200, False, prompt, completion,
                    False, 0.0, 0.02, 0.001, 0.0, now - sent_ago if replica else 0.0, now, None)


async def test_usage_is_summed_per_pair_and_written_once_per_flush(monkeypatch):
    monkeypatch.setattr(accounting, "FLUSH_EVERY", 0.05)
    store, background = FlakyStore(), Background()
    step = RecordUsage(store, background.run)
    for _ in range(100):
        step.observe(finished("k1", "m", 10, 2))
    step.observe(finished("k1", "m", 5, 5, rented="cloud"))
    step.observe(finished("k2", "m", 1, 1))
    step.observe(finished(None, "m", backend=None))  # refused: not counted
    assert store.writes == []  # nothing on the request path
    await asyncio.sleep(0.2)
    await background.drain(1)
    assert sorted(store.writes) == [("k1", "m", 1, 5, 5, True), ("k1", "m", 100, 1000, 200, False),
                                    ("k2", "m", 1, 1, 1, False)]


async def test_a_variants_usage_is_its_own_row_and_the_admin_view_sums_it_into_the_model():
    store, background = FlakyStore(), Background()
    step = RecordUsage(store, background.run)
    step.observe(finished("k1", "chat", 10, 2, variant="bf16"))
    step.observe(finished("k1", "chat", 10, 4, variant="fp8"))
    step.observe(finished("k1", "chat", 1, 1, variant="fp8"))
    step.observe(finished("k1", "plain", 3, 3))
    await step.flush()
    assert sorted(store.writes) == [("k1", "chat#bf16", 1, 10, 2, False), ("k1", "chat#fp8", 2, 11, 5, False),
                                    ("k1", "plain", 1, 3, 3, False)]
    rows = {model: {"requests": r, "prompt_tokens": p, "completion_tokens": c} for _, model, r, p, c, _ in store.writes}
    models, variants = by_model(rows)
    assert models == {"chat": {"requests": 3, "prompt_tokens": 21, "completion_tokens": 7},
                      "plain": {"requests": 1, "prompt_tokens": 3, "completion_tokens": 3}}
    assert variants == {"chat": {"bf16": {"requests": 1, "prompt_tokens": 10, "completion_tokens": 2},
                                 "fp8": {"requests": 2, "prompt_tokens": 11, "completion_tokens": 5}}}


async def test_a_refused_batch_is_kept_for_the_next_flush():
    store = FlakyStore()
    step = RecordUsage(store, Background().run)
    step.observe(finished("k1", "m", 3, 4))
    store.down = True
    with pytest.raises(ConnectionError):
        await step.flush()
    step.observe(finished("k1", "m", 1, 1))
    store.down = False
    await step.flush()
    assert store.writes == [("k1", "m", 2, 4, 5, False)]


def ledger_call(key: str, backend: str = "gpu-0") -> Finished:
    """A finished owned call: sent 10 ms before it finished."""
    return finished(key, "m", 3, 4, backend=backend)


async def test_the_ledger_writes_off_the_path_keeps_a_refused_batch_and_bounds_it(tmp_path, monkeypatch):
    """The SQLite file's folder is missing (a real refusal), then made: nothing is lost or counted twice; a
    refused batch larger than the bound is dropped and counted, so memory stays bounded while the store is down."""
    folder = tmp_path / "not-yet"
    ledger, lost, background = SQLiteLedger(str(folder / "gateway.db")), [], Background()
    step = RecordLedger(ledger, Ledger(flush_seconds=0.05), background.run, lost.append)
    for _ in range(3):
        step.observe(ledger_call("k1"))
    with pytest.raises(StoreUnavailable):
        await step.flush()
    step.observe(ledger_call("k1"))
    folder.mkdir()
    deadline = time.monotonic() + 10
    while not (rows := {row: v for row, v in await ledger.read(0, time.time() + 60) if row.served}):
        assert time.monotonic() < deadline, "the step's own timer never flushed the kept batch"
        await asyncio.sleep(0.05)  # the step's own timer flushes, off the request path
    await background.drain(1)
    assert [(row.key_id, v[REQUESTS]) for row, v in rows.items()] == [("k1", 4)] and lost == []

    monkeypatch.setattr(record, "MAX_ROWS", 3)
    await ledger.close()
    ledger = step.ledger = SQLiteLedger(str(tmp_path / "gone" / "gateway.db"))
    for backend in ("a", "b", "c"):  # three key rows and three backend-time rows: past the bound of 3
        step.observe(ledger_call("k1", backend))
    with pytest.raises(StoreUnavailable):
        await step.flush()
    step.timer.cancel()
    assert lost == ["dropped"] and step.sums.take() == ({}, {})
    await ledger.close()


async def test_access_log_batches_lines_formatted_like_the_log(monkeypatch, caplog):
    stream = io.StringIO()
    monkeypatch.setattr(AccessLog, "stream", stream)
    access = AccessLog()
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        for i in range(3):
            access.write(f"req-{i}", "chat/completions", "m", "gpu-1", 200, False, 0.0123)
        assert stream.getvalue() == ""  # buffered, not written per request
        await asyncio.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].endswith(" INFO gateway.access request_id=req-0 endpoint=chat/completions model=m"
                             " backend=gpu-1 status=200 stream=False duration_ms=12.3")
    assert lines[0][:4].isdigit() and lines[0][19] == ","  # 2026-12-02 14:28:37,123


async def test_access_log_follows_the_logger_level(monkeypatch, caplog):
    stream = io.StringIO()
    monkeypatch.setattr(AccessLog, "stream", stream)
    access = AccessLog()
    with caplog.at_level(logging.WARNING, logger="gateway.access"):
        access.write("req", "completions", "m", "b", 200, True, 0.001)
    access.flush()
    assert stream.getvalue() == ""


async def test_background_reports_dropped_and_failed_writes(monkeypatch):
    lost: list[str] = []
    runner = Background(lost.append)

    async def fails():
        raise ConnectionError("store down")

    async def slow():
        await asyncio.sleep(0.05)

    monkeypatch.setattr(background_module, "MAX_PENDING", 1)
    runner.run(slow())
    runner.run(slow())  # the backlog is full: dropped, never started
    await runner.drain(1)
    runner.run(fails())
    await runner.drain(1)
    await asyncio.sleep(0)
    assert lost == ["dropped", "failed"] and runner.dropped == 1
