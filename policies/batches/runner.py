"""The background runner: runs open batches' lines, a few at a time, through the same pipeline and admission as
any call (gateway/batch_calls.py builds each call), so batch lines wait in the batch priority class behind
interactive work and count in budgets, usage and the ledger.

Each gateway process runs one; with several on one Redis they share the lines through claims (see
policies/batches/store.py): a line is claimed before it runs, its claim renewed while it runs, and its result
recorded only under that claim, so every line is answered exactly once and a dead process's lines are claimed
again once their claims expire. A line that finds no capacity (429, 503) goes back to pending and is tried
later; any other answer, success or error, is its result. A line preempted (its slot given to a better class's
request, policies/preemption.py) runs again at once under its claim, up to `batch.max_preemptions` times; the run
after those may not be preempted, so every line ends.

A batch's status moves as OpenAI documents: validating -> in_progress -> finalizing -> completed; cancelling ->
cancelled; expired once its window passes. Writing the output files is claimed too (`_settling`, a time), so one
process writes them; output ids follow from the batch's id, so a process that dies while writing and another
that writes them again leave one file each. Output files count against the key's bounds but are written even past
them (a batch's results are never lost); the key's uploads are refused until it is back under.

Every batch.sweep_seconds the loop also deletes expired files (bytes, then record), up to SWEEP_FILES a sweep;
an input file of a batch not yet ended is kept until the batch ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple

import orjson

from policies.config.batches import BatchSettings
from policies.batches.files import FileDir
from policies.batches.jsonl import Lines
from policies.batches.service import add_usage, no_usage
from policies.batches.store import OPEN, BatchStore
from policies.preemption import PREEMPTIBLE
from policies.store import StoreUnavailable

log = logging.getLogger("gateway.batches")
SWEEP_FILES = 200  # expired files deleted per sweep: bounded work in the runner's loop
SETTLE_PAGE = 1_000  # results read from the store at a time while a batch's output files are written
# a temporary file (an upload or a write under way) untouched this long was left by a process that died: the edge's
# body-rate bound ends any live upload that stalls for far less
STALE_TEMPORARY = 6 * 3600.0


class TryLater(Exception):
    """No capacity for the line now (the queue refused it, no backend is up, the store is failing over)."""


class Preempted(TryLater):
    """The line's call was stopped to give its slot to a better class's request (policies/preemption.py): it runs
    again."""


class Answer(NamedTuple):
    status: int
    body: Any  # the JSON answer (or an OpenAI error object)
    request_id: str


Execute = Callable[[dict[str, Any], dict[str, Any]], Awaitable[Answer]]  # (batch record, line) -> its answer


def output_line(line: dict[str, Any], answer: Answer) -> bytes:
    return orjson.dumps({"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line["custom_id"],
                         "response": {"status_code": answer.status, "request_id": answer.request_id,
                                      "body": answer.body}, "error": None})


def failed_line(line: dict[str, Any], code: str, message: str) -> bytes:
    return orjson.dumps({"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line["custom_id"],
                         "response": None, "error": {"code": code, "message": message}})


def answered(result: bytes) -> Any:
    """The answer's body in an output line (output_line), or None."""
    try:
        line = orjson.loads(result)
    except orjson.JSONDecodeError:
        return None
    response = line.get("response") if isinstance(line, dict) else None
    return response.get("body") if isinstance(response, dict) else None


class Runner:
    def __init__(self, store: BatchStore, settings: Callable[[], BatchSettings], execute: Execute,
                 name: str | None = None) -> None:
        self.store = store
        self.settings = settings
        self.execute = execute
        self.name = name or secrets.token_hex(8)  # this process's claims
        self.driving: dict[str, asyncio.Task[None]] = {}
        self.wake = asyncio.Event()
        self.stopping = False  # claim nothing more: the process is shutting down
        self.in_flight = 0  # lines of every batch running in this process (batch.max_in_flight bounds it)
        self.outage_logged = False  # a store outage is said once, not at every poll
        self.swept = 0.0  # when this process last deleted expired files (monotonic)

    async def run_forever(self) -> None:
        while True:
            try:
                records = [] if self.stopping else await self.store.open_batches()
                for record in records:
                    batch_id: str = record["id"]
                    if batch_id not in self.driving:
                        task = asyncio.create_task(self.drive(batch_id))
                        self.driving[batch_id] = task
                        task.add_done_callback(partial(self.forget, batch_id))
                if not self.stopping and time.monotonic() - self.swept >= self.settings().sweep_seconds:
                    self.swept = time.monotonic()
                    await self.sweep({r["input_file_id"] for r in records})
            except StoreUnavailable:  # an outage, not a bug: said once, batches wait until the store answers
                self.store_down()
            except Exception:  # a bug: say so and look again
                log.exception("batch runner could not list open batches")
            else:
                self.outage_logged = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.settings().poll_seconds)
            self.wake.clear()

    async def sweep(self, in_use: set[str]) -> int:
        """Delete up to SWEEP_FILES expired files but those in `in_use` (inputs of batches not yet ended); the
        bytes first, so a process dying between leaves a record the next sweep deletes, never orphaned bytes.
        Gateway processes sweeping at once delete a file once: both steps are no-ops the second time."""
        files = FileDir(self.settings().files_dir)
        await files.drop_stale_temporaries(time.time() - STALE_TEMPORARY)
        deleted = 0
        for owner, file_id in await self.store.expired_files(time.time(), SWEEP_FILES + len(in_use)):
            if file_id in in_use:
                continue
            await files.delete(file_id)
            await self.store.delete_file(owner, file_id)
            deleted += 1
            if deleted == SWEEP_FILES:
                break
        return deleted

    def forget(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self.driving.pop(batch_id, None)

    async def stop(self, grace: float = 10.0) -> None:
        """Claim no more lines, give the ones in flight `grace` seconds to finish and be recorded, then stop the
        rest (their claims are given back, so another process, or this one restarted, runs them at once)."""
        self.stopping = True
        tasks = list(self.driving.values())
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def drive(self, batch_id: str) -> None:
        """Run one batch's lines from this process until none is left to claim, then settle it."""
        try:
            await self._drive(batch_id)
        except asyncio.CancelledError:
            raise
        except StoreUnavailable:
            self.store_down()
            await asyncio.sleep(self.settings().poll_seconds)
        except Exception:
            log.exception("batch %s: runner failed; it is picked up again", batch_id)
            await asyncio.sleep(self.settings().poll_seconds)

    def store_down(self) -> None:
        if not self.outage_logged:
            self.outage_logged = True
            log.warning("batch runner: the store is unavailable; open batches resume when it answers")

    async def _drive(self, batch_id: str) -> None:
        record = await self.store.get_batch(None, batch_id)
        if record is None or record["status"] not in OPEN:
            return
        if record["status"] == "validating":
            record["status"], record["in_progress_at"] = "in_progress", int(time.time())
            await self.store.swap(record)  # or another process did it first: either way it is in progress
        settings = self.settings()
        data = await FileDir(settings.files_dir).mapped(record["input_file_id"])
        if data is None:
            await self.fail(batch_id, "file_not_found", "the input file is gone")
            return
        lines = Lines(data)  # each line parsed when it is claimed: a batch holds no parsed file
        running: dict[int, asyncio.Task[None]] = {}
        renewed = time.monotonic()
        try:
            while True:
                settings = self.settings()
                record = await self.store.get_batch(None, batch_id)
                if record is None or record["status"] not in OPEN:
                    return
                ending = self.ending(record)
                if self.stopping:
                    if not running:
                        return
                elif ending:  # lines in flight stop (one may wait minutes for a slot) and go back with the claims
                    # that expired (claiming none), then nothing pending runs
                    await self.stop_lines(batch_id, running)
                    await self.store.claim(batch_id, self.name, 0, 0.0, time.time())
                    await self.store.drop_pending(batch_id)
                elif (room := min(settings.concurrency - len(running), settings.max_in_flight - self.in_flight)) > 0:
                    now = time.time()
                    self.in_flight += room  # held while the claim is under way: another batch's driver, running
                    try:  # meanwhile, must not count the same room
                        claimed = await self.store.claim(batch_id, self.name, room, now + settings.claim_seconds, now)
                    finally:
                        self.in_flight -= room
                    for n in claimed:
                        running[n] = self.start_line(record, n, lines[n])
                if not running and not ending and self.in_flight >= settings.max_in_flight:  # other batches hold it all
                    await asyncio.sleep(settings.poll_seconds)
                    continue
                if not running:
                    progress = await self.store.progress(batch_id)
                    if progress.pending == 0 and progress.claimed == 0:
                        await self.settle(batch_id, ending or "completed")
                        return
                    if progress.pending == 0 or ending:  # other processes hold the rest: look again later
                        await asyncio.sleep(settings.poll_seconds)
                        continue
                if running:
                    done, _ = await asyncio.wait(running.values(), timeout=settings.poll_seconds,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    for n in [n for n, t in running.items() if t in done]:
                        running.pop(n).result()
                if time.monotonic() - renewed > settings.claim_seconds / 3:
                    renewed = time.monotonic()
                    await self.store.renew(batch_id, self.name, list(running), time.time() + settings.claim_seconds)
        finally:
            data.close()  # the lines in flight were parsed when claimed: none reads the map any more
            for task in running.values():
                task.cancel()
            if running:  # given back, so they run again at once (else when their claims expire)
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.release_all(batch_id, list(running)))

    async def stop_lines(self, batch_id: str, running: dict[int, asyncio.Task[None]]) -> None:
        """Stop the lines this process runs of a batch that is ending; one that finished meanwhile keeps its result."""
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        await self.release_all(batch_id, list(running))  # a line already recorded is no longer claimed: no-op
        running.clear()

    async def release_all(self, batch_id: str, lines: list[int]) -> None:
        for n in lines:
            await self.store.release(batch_id, self.name, n)

    def ending(self, record: dict[str, Any]) -> str | None:
        if record["status"] == "cancelling":
            return "cancelled"
        if time.time() >= record["expires_at"]:
            return "expired"
        return None

    def start_line(self, record: dict[str, Any], n: int, line: dict[str, Any]) -> asyncio.Task[None]:
        """The line's task, counted in `in_flight` from now until it ends, cancelled before it started too."""
        self.in_flight += 1
        task = asyncio.create_task(self.run_line(record, n, line))
        task.add_done_callback(self._line_ended)
        return task

    def _line_ended(self, task: asyncio.Task[None]) -> None:
        self.in_flight -= 1

    async def run_line(self, record: dict[str, Any], n: int, line: dict[str, Any]) -> None:
        batch_id = record["id"]
        try:
            answer = await self.runs(record, line)
        except TryLater:
            await self.store.release(batch_id, self.name, n)
            await asyncio.sleep(self.settings().poll_seconds)  # the line's slot stays empty for a moment
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s line %d failed inside the gateway", batch_id, n)
            ok, result = False, failed_line(line, "internal_error", "the gateway failed to run this line")
        else:
            ok = 200 <= answer.status < 300
            result = output_line(line, answer)
        if not await self.store.complete(batch_id, self.name, n, ok, result):
            log.warning("batch %s line %d: its claim had expired; the result of the process now holding it counts",
                        batch_id, n)

    async def runs(self, record: dict[str, Any], line: dict[str, Any]) -> Answer:
        """The line's answer: a run preempted is run again at once (it waits for a slot in its class's turn), and
        the run after batch.max_preemptions of them (or any, with batch.preempt off) may not be preempted."""
        settings = self.settings()
        left = settings.max_preemptions if settings.preempt else 0
        while True:  # bounded: `left` falls by one a pass, and a run with none left is not preempted
            allowed = PREEMPTIBLE.set(left > 0)
            try:
                return await self.execute(record, line)
            except Preempted:
                if left <= 0:
                    raise  # not ours to preempt: tried later as any line refused for capacity
                left -= 1
                log.debug("batch %s line %s was preempted; it runs again", record["id"], line.get("custom_id"))
            finally:
                PREEMPTIBLE.reset(allowed)

    async def fail(self, batch_id: str, code: str, message: str) -> None:
        record = await self.store.get_batch(None, batch_id)
        if record is not None and record["status"] in OPEN:
            await self.store.drop_pending(batch_id)
            record.update(status="failed", failed_at=int(time.time()),
                          errors={"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                              "line": None}]})
            await self.store.swap(record)

    async def settle(self, batch_id: str, final: str) -> None:
        """Write the output and error files and end the batch as `final`, unless another process is at it."""
        settings = self.settings()
        record = await self.store.get_batch(None, batch_id)
        now = time.time()
        if record is None or record["status"] not in OPEN:
            return
        if record.get("_settling") and now - record["_settling"] < settings.claim_seconds:
            return  # another process is writing them
        record["_settling"] = now
        if final == "completed":
            record["status"], record["finalizing_at"] = "finalizing", int(now)
        if not await self.store.swap(record):
            return
        record["_v"] += 1
        files = FileDir(settings.files_dir)
        total = record["request_counts"]["total"]
        counts = {"total": total, "completed": 0, "failed": 0}
        usage = no_usage()  # the answered lines' tokens, summed as the output file is written
        keep = record.get("_keep_output") or settings.output_retention_seconds  # the batch's output_expires_after
        async with files.incoming() as outputs, files.incoming() as errors:  # a page of results at a time
            for first in range(0, total, SETTLE_PAGE):
                for _, ok, result in await self.store.results(batch_id, first, min(total, first + SETTLE_PAGE)):
                    counts["completed" if ok else "failed"] += 1
                    if ok:
                        add_usage(usage, answered(result))
                    await (outputs if ok else errors).write(result + b"\n")
            for kind, written in (("output", outputs), ("error", errors)):
                if not written.size:
                    continue
                file_id = f"file-{kind}-{batch_id.removeprefix('batch_')}"
                await written.keep(file_id)
                created = int(time.time())
                await self.store.put_file({"id": file_id, "object": "file", "bytes": written.size,
                                           "created_at": created, "filename": f"{batch_id}_{kind}.jsonl",
                                           "purpose": "batch_output", "status": "processed",
                                           "expires_at": created + keep, "status_details": None,
                                           "_owner": record["_owner"],
                                           "_created": time.time()})  # no bound: results are never lost
                record[f"{kind}_file_id"] = file_id
        record.update(status=final, request_counts=counts, usage=usage, _settling=None)
        record[f"{final}_at"] = int(time.time())
        if not await self.store.swap(record):
            log.warning("batch %s changed while its files were written; it is settled again", batch_id)
