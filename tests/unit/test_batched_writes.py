"""Work moved off the request path: usage summed and written in batches, access-log lines written in batches."""

from __future__ import annotations

import asyncio
import io
import logging
from types import SimpleNamespace

import pytest

from gateway.access_log import AccessLog
from gateway import background as background_module
from gateway.background import Background
from policies import accounting
from policies.accounting import RecordUsage, by_model


class FlakyStore:
    def __init__(self) -> None:
        self.writes: list[tuple] = []
        self.down = False

    async def add_usage(self, key_id, model, *, requests, prompt_tokens, completion_tokens, rented=False):
        if self.down:
            raise ConnectionError("store down")
        self.writes.append((key_id, model, requests, prompt_tokens, completion_tokens, rented))


def finished(key: str, model: str, prompt: int, completion: int, rented: str | None = None, variant=None):
    return SimpleNamespace(key=SimpleNamespace(id=key), model=model, replica=SimpleNamespace(rented=rented),
                           usage={"prompt_tokens": prompt, "completion_tokens": completion},
                           group=f"{model}#{variant}" if variant else "")


async def test_usage_is_summed_per_pair_and_written_once_per_flush(monkeypatch):
    monkeypatch.setattr(accounting, "FLUSH_EVERY", 0.05)
    store, background = FlakyStore(), Background()
    step = RecordUsage(store, background.run)
    for _ in range(100):
        await step.leave(finished("k1", "m", 10, 2))
    await step.leave(finished("k1", "m", 5, 5, rented="cloud"))
    await step.leave(finished("k2", "m", 1, 1))
    await step.leave(SimpleNamespace(key=None, model="m", replica=None, usage=None))  # refused: not counted
    assert store.writes == []  # nothing on the request path
    await asyncio.sleep(0.2)
    await background.drain(1)
    assert sorted(store.writes) == [("k1", "m", 1, 5, 5, True), ("k1", "m", 100, 1000, 200, False),
                                    ("k2", "m", 1, 1, 1, False)]


async def test_a_variants_usage_is_its_own_row_and_the_admin_view_sums_it_into_the_model():
    store, background = FlakyStore(), Background()
    step = RecordUsage(store, background.run)
    await step.leave(finished("k1", "chat", 10, 2, variant="bf16"))
    await step.leave(finished("k1", "chat", 10, 4, variant="fp8"))
    await step.leave(finished("k1", "chat", 1, 1, variant="fp8"))
    await step.leave(finished("k1", "plain", 3, 3))
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
    await step.leave(finished("k1", "m", 3, 4))
    store.down = True
    with pytest.raises(ConnectionError):
        await step.flush()
    await step.leave(finished("k1", "m", 1, 1))
    store.down = False
    await step.flush()
    assert store.writes == [("k1", "m", 2, 4, 5, False)]


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
