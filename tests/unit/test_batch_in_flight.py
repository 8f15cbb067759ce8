"""One process runs at most `batch.max_in_flight` lines of all its batches (policies/batches/runner.py), even when
its store answers a claim slowly: two batches' drivers, each claiming while the other waits on the store, must not
both count the same room. On a real SQLite store and a real files directory; only the store's round trip is
lengthened, as a remote Redis's is."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson

from policies.config.batches import BatchSettings
from policies.batches.runner import Answer, Runner
from policies.batches.sqlite import SQLiteBatches

LINES, CONCURRENCY, MAX_IN_FLIGHT = 8, 4, 3


class SlowClaims(SQLiteBatches):
    async def claim(self, batch_id: str, runner: str, count: int, until: float, now: float) -> list[int]:
        await asyncio.sleep(0.01)  # the other batch's driver runs meanwhile
        return await super().claim(batch_id, runner, count, until, now)


class LineRuns:
    """The lines' executor: counts how many run at once, and lets each finish after a few turns."""

    def __init__(self) -> None:
        self.now = self.most = self.ran = 0

    async def execute(self, _record: dict, line: dict) -> Answer:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(0.02)
        finally:
            self.now -= 1
        self.ran += 1
        return Answer(200, {"id": line["custom_id"]}, "req")


async def test_two_batches_claiming_on_a_slow_store_stay_within_max_in_flight(tmp_path: Path):
    store = SlowClaims(str(tmp_path / "gateway.db"))
    settings = BatchSettings(files_dir=str(tmp_path / "files"), concurrency=CONCURRENCY,
                             max_in_flight=MAX_IN_FLIGHT, poll_seconds=0.05)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "file-in").write_bytes(b"".join(
        orjson.dumps({"custom_id": f"r-{n}", "method": "POST", "url": "/v1/chat/completions", "body": {}}) + b"\n"
        for n in range(LINES)))
    lines = LineRuns()
    runner = Runner(store, lambda: settings, lines.execute)
    try:
        ids = ["batch_one", "batch_two"]
        for batch_id in ids:
            await store.create_batch({"id": batch_id, "object": "batch", "status": "in_progress", "_owner": "k1",
                                      "input_file_id": "file-in", "expires_at": time.time() + 600,
                                      "_created": time.time(), "_v": 0, "request_counts": {"total": LINES}}, LINES)
        await asyncio.wait_for(asyncio.gather(*(runner.drive(i) for i in ids)), 60)
        assert lines.ran == 2 * LINES
        assert lines.most == MAX_IN_FLIGHT  # reached, and never passed
        assert runner.in_flight == 0  # every line counted out, as many as were counted in
        assert [(await store.get_batch(None, i))["status"] for i in ids] == ["completed"] * 2
    finally:
        await store.close()
