"""A batch's output and error files are written a page of results at a time (policies/batches/runner.py
`settle`), on a real SQLite store and a real files directory: every result in line order, the good ones in the
output file and the failed ones in the error file, and no more of them held in memory than a page."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

from policies.config.batches import BatchSettings
from policies.batches.runner import Answer, Runner
from policies.batches.sqlite import SQLiteBatches

LINES, SIZE = 4_000, 5_000  # 20 MB of results


async def never(_record: dict, _line: dict) -> Answer:
    raise AssertionError("no line runs here: the results are recorded by the test")


async def test_the_output_files_are_every_result_in_order_written_a_page_at_a_time(tmp_path: Path):
    store = SQLiteBatches(str(tmp_path / "gateway.db"))
    settings = BatchSettings(files_dir=str(tmp_path / "files"))
    runner = Runner(store, lambda: settings, never)
    try:
        await store.create_batch({"id": "batch_big", "object": "batch", "status": "in_progress", "_owner": "k1",
                                  "_created": time.time(), "_v": 0, "request_counts": {"total": LINES}}, LINES)
        now = time.time()
        while lines := await store.claim("batch_big", "r", 500, now + 600, now):
            for n in lines:
                result = b'{"custom_id": "r-%d", "pad": "%s"}' % (n, b"x" * SIZE)
                assert await store.complete("batch_big", "r", n, n % 100 != 7, result)
        tracemalloc.start()
        try:
            await runner.settle("batch_big", "completed")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        done = await store.get_batch(None, "batch_big")
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": LINES, "completed": LINES - 40, "failed": 40}
        output = (tmp_path / "files" / done["output_file_id"]).read_bytes().splitlines()
        errors = (tmp_path / "files" / done["error_file_id"]).read_bytes().splitlines()
        assert [int(x[17:x.index(b'"', 17)]) for x in output] == [n for n in range(LINES) if n % 100 != 7]
        assert [int(x[17:x.index(b'"', 17)]) for x in errors] == list(range(7, LINES, 100))
        assert (await store.get_file("k1", done["output_file_id"]))["bytes"] > LINES * SIZE * 0.9
        assert peak < 12_000_000, peak  # a page (5 MB) and its copy; all at once it was the 20 MB three times over
    finally:
        await store.close()
