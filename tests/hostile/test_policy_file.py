"""A policy file written in pieces is never applied half-written, however it is written.

The live gateway serves models a and b; the new file serves a, b and c (models last, so the file cut after model
a is itself a valid policy that lacks b). The file is written in two pieces with a pause shorter than the settle
time between them, and a reload is asked for right after the first piece (as SIGHUP or a poll landing there
would): calls to b keep answering 200 throughout, b is never missing from the serving policy, and the whole new
file (c) serves once it has settled. A file renamed into place is applied promptly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import httpx

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.app import create_app
from gateway.reload import SETTLE
from policies.config import load_policy
from tests.support.gateway import AUTH, default_key_record
from tests.support.probes import eventually
from tests.support.servers import serve_app

SIM = SimConfig(model="served", step_base_ms=1)
PAUSE = SETTLE / 3  # between the two pieces: well inside the settle time


def policy_text(store: str, sims: list[str], models: str) -> str:
    text = (f"store: {{kind: sqlite, path: '{store}'}}\n"
            "health: {interval: 0.2, backoff_initial: 0.2}\n"
            "models:\n")
    for name, url in zip(models, sims):
        text += f"  - name: {name}\n    served_name: served\n    backends: [{{url: '{url}', name: r{name}}}]\n"
    return text


def models_of(gw) -> set[str]:
    return {m.name for m in gw.policy.models}


class CallsToB:
    """Calls to model b in a loop until stopped (bounded), each status kept, and whether b was in the serving
    policy at each turn."""

    def __init__(self, url: str, gw) -> None:
        self.url, self.gw = url, gw
        self.statuses: list[int] = []
        self.missing = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=30) as http:
            for _ in range(5000):
                if self.stop.is_set():
                    return
                self.missing += "b" not in models_of(self.gw)
                r = await http.post("/v1/chat/completions", json={
                    "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                self.statuses.append(r.status_code)


@contextlib.asynccontextmanager
async def gateway_on_a_file(tmp_path: Path):
    async with serve_app(simulator(SIM)) as s1, serve_app(simulator(SIM)) as s2, serve_app(simulator(SIM)) as s3:
        sims = [s1, s2, s3]
        path = tmp_path / "policy.yaml"
        store = str(tmp_path / "keys.db")
        path.write_text(policy_text(store, sims, "ab"))
        app = create_app(load_policy(path), policy_path=str(path))
        gw = app.state
        await gw.store.create_key(default_key_record())
        async with serve_app(app) as url:
            async def both_ready() -> bool:
                ready = gw.replicas.ready()
                return bool(ready.get("a") and ready.get("b"))

            await eventually(both_ready, 20)
            assert gw.reloader is not None
            yield url, gw, path, policy_text(store, sims, "abc")


async def written_in_pieces(tmp_path: Path, write_first) -> None:
    """`write_first(path, first_piece)` leaves the file holding the first piece and returns the open file; the
    rest follows after PAUSE, with a reload asked for in between."""
    async with gateway_on_a_file(tmp_path) as (url, gw, path, new):
        cut = new.index("  - name: b\n")
        calls = CallsToB(url, gw)
        task = asyncio.create_task(calls.run())
        try:
            await eventually(lambda: _true(len(calls.statuses) >= 3), 20)
            f = write_first(path, new[:cut])
            try:
                gw.reloader.wake.set()  # what SIGHUP does: a reload asked for while the file is half-written
                await asyncio.sleep(PAUSE)
                f.write(new[cut:])
            finally:
                f.close()
            await eventually(lambda: _true("c" in models_of(gw)), 30)  # the whole file, once settled
            done = len(calls.statuses)
            await eventually(lambda: _true(len(calls.statuses) >= done + 3), 20)
        finally:
            calls.stop.set()
            await task
        assert calls.missing == 0, "model b was missing from the serving policy: a half-written file was applied"
        assert set(calls.statuses) == {200}, sorted(set(calls.statuses))
        assert models_of(gw) == {"a", "b", "c"}


async def _true(value: bool) -> bool:
    return value


def new_file(path: Path, first: str):
    """Deleted, then created anew and written in pieces (a new inode, not renamed into place)."""
    path.unlink()
    f = open(path, "w")  # noqa: SIM115 - closed by the caller after the second piece
    f.write(first)
    f.flush()
    return f


def in_place(path: Path, first: str):
    """Truncated and rewritten in place (the same inode), in pieces."""
    f = open(path, "r+")  # noqa: SIM115 - closed by the caller after the second piece
    f.truncate(0)
    f.write(first)
    f.flush()
    return f


async def test_a_policy_file_deleted_and_written_anew_in_two_pieces_is_never_applied_half(tmp_path):
    await written_in_pieces(tmp_path, new_file)


async def test_a_policy_file_rewritten_in_place_in_two_pieces_is_never_applied_half(tmp_path):
    await written_in_pieces(tmp_path, in_place)


async def test_a_policy_file_renamed_into_place_is_applied_promptly(tmp_path):
    async with gateway_on_a_file(tmp_path) as (_url, gw, path, new):
        temporary = path.with_name(".policy.yaml.tmp")
        temporary.write_text(new)
        os.replace(temporary, path)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await eventually(lambda: _true("c" in models_of(gw)), 30)
        # a poll (interval 1 s) and the settle time, with a wide margin for a slow, shared machine
        assert loop.time() - started < 4 * (gw.reloader.interval + SETTLE)
