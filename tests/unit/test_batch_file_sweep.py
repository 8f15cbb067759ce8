"""The runner's sweep of expired batch files, on a real SQLite store and a real files directory: one sweep deletes
at most SWEEP_FILES files (bytes and record), the earliest expired first, never an input of a batch not yet ended,
even when those are the earliest; temporary files a dead process left go too; and an upload's `expires_after` is
OpenAI's or a 400 naming it."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from policies.config.batches import BatchSettings
from policies.batches.runner import STALE_TEMPORARY, SWEEP_FILES, Answer, Runner
from policies.batches.service import expires_after
from policies.batches.sqlite import SQLiteBatches
from policies.errors import BadRequest


async def never(_record: dict, _line: dict) -> Answer:
    raise AssertionError("no line runs in these tests")


@pytest.fixture
async def runner(tmp_path: Path) -> AsyncIterator[Runner]:
    store = SQLiteBatches(str(tmp_path / "gateway.db"))
    settings = BatchSettings(files_dir=str(tmp_path / "files"))
    yield Runner(store, lambda: settings, never)
    await store.close()


async def expired(runner: Runner, count: int, ago: float) -> list[str]:
    """`count` files of one key that expired `ago` seconds ago (and a second apart), their bytes on disk."""
    folder, ids = Path(runner.settings().files_dir), []
    folder.mkdir(exist_ok=True)
    for n in range(count):
        file_id = f"file-{ago:.0f}-{n}"
        (folder / file_id).write_bytes(b"{}\n")
        await runner.store.put_file({"id": file_id, "object": "file", "bytes": 3, "_owner": "k1",
                                     "_created": time.time(), "expires_at": time.time() - ago - n})
        ids.append(file_id)
    return ids


async def test_one_sweep_deletes_at_most_its_bound_and_never_an_input_in_use(runner: Runner, tmp_path: Path):
    in_use = await expired(runner, 3, ago=10_000)  # the earliest expired: inputs of batches still running
    others = await expired(runner, SWEEP_FILES + 20, ago=100)
    assert await runner.sweep(set(in_use)) == SWEEP_FILES
    left = sorted(p.name for p in (tmp_path / "files").iterdir())
    assert len(left) == 3 + 20 and set(in_use) <= set(left)
    assert await runner.store.usage("k1") == (23, 69)
    assert set(left) - set(in_use) == set(others[:20])  # the latest expired wait for the next sweep
    assert await runner.sweep(set(in_use)) == 20
    assert await runner.sweep(set()) == 3  # their batches ended
    assert list((tmp_path / "files").iterdir()) == [] and await runner.store.usage("k1") == (0, 0)


async def test_a_file_not_yet_expired_stays(runner: Runner, tmp_path: Path):
    await expired(runner, 2, ago=-3600)  # expiring in an hour
    assert await runner.sweep(set()) == 0 and len(list((tmp_path / "files").iterdir())) == 2


@pytest.mark.parametrize("anchor,seconds,param", [
    ("created_at", "3599", "expires_after[seconds]"), ("created_at", "2592001", "expires_after[seconds]"),
    ("created_at", "-5", "expires_after[seconds]"), ("created_at", "1e4", "expires_after[seconds]"),
    ("created_at", None, "expires_after[seconds]"), (None, "3600", "expires_after[anchor]"),
    ("last_active_at", "3600", "expires_after[anchor]")])
def test_expires_after_outside_openais_range_is_a_400_naming_it(anchor, seconds, param):
    with pytest.raises(BadRequest) as refused:
        expires_after(anchor, seconds)
    assert refused.value.param == param and refused.value.status == 400


def test_expires_after_within_openais_range():
    assert expires_after(None, None) is None
    assert expires_after("created_at", "3600") == 3600 and expires_after("created_at", "2592000") == 2592000


async def test_a_sweep_drops_temporary_files_a_dead_process_left_and_keeps_live_ones(runner, tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    dead = [folder / ".upload-0123456789abcdef.4242.tmp", folder / ".file-abc.4242.tmp"]
    live = folder / ".upload-fedcba9876543210.99.tmp"
    kept = folder / "file-kept"  # a file of its own: the sweep of temporaries never touches it
    for path in [*dead, live, kept]:
        path.write_bytes(b"{}")
    old = time.time() - STALE_TEMPORARY - 60
    for path in [*dead, kept]:
        os.utime(path, (old, old))
    await runner.sweep(set())
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, kept.name])
