"""Hot reload of the policy file: on a change of the file (polled) and on SIGHUP.

A Kubernetes ConfigMap mount changes by swapping a symlink (`..data`) to a new directory, so the file's own
path keeps its inode and mtime is unreliable through the link: the watch compares the resolved target, its
mtime, size and inode each `interval`. A file is only ever applied once it has settled: it is read (its stamp
and its bytes), then again `settle` seconds later, and both reads must find the same stamp and the same bytes.
Nothing about how the file was written is trusted: renamed into place and a ConfigMap's symlink swap are atomic,
but a file rewritten in place (truncated, then written in pieces) or written new (deleted, then created and
written in pieces) is readable half-written, and a half file may well parse and validate (a list of models cut
after the first). Any change while settling starts the wait again on the next poll. A settled text is validated
completely (schema, then the egress rules) before anything changes; a file that fails is refused, the log names
the field, and the policy that was serving stays. A good one becomes a new snapshot (policies/snapshot.py) and is
swapped in at once; requests in flight finish under the one they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from typing import Protocol

from backends.egress import Resolver
from backends.replicas import ReplicaSet
from gateway.admin.audit import AdminAudit
from gateway.http.asgi import AnyConnection
from policies.audit import scrub_text
from policies.config import PolicyError, parse_policy
from policies.egress import check_backends
from policies.discovery import Discovery
from policies.live_metrics import LiveMetrics
from policies.snapshot import Shared, Snapshot, apply_static_replicas, compile_snapshot, restart_needed, version_of

log = logging.getLogger("gateway.reload")

OK, INVALID, UNCHANGED, CHANGING = "ok", "invalid", "unchanged", "changing"

# s a file must stay unchanged (stamp and bytes) before it is applied: longer than the pauses of an editor or a
# script writing it piecewise, short enough that an update applies within about interval + settle.
SETTLE = 1.0

Stamp = tuple[str, int, int, int]


class Reloadable(Protocol):
    """What a reload reads and swaps of the gateway (gateway/wiring.py `Gateway`)."""

    @property
    def snapshot(self) -> Snapshot: ...
    @property
    def resolver(self) -> Resolver: ...
    @property
    def replicas(self) -> ReplicaSet: ...
    @property
    def shared(self) -> Shared: ...
    @property
    def discovery(self) -> Discovery: ...
    @property
    def live_metrics(self) -> LiveMetrics: ...
    @property
    def audit(self) -> AdminAudit: ...
    def install(self, snapshot: Snapshot) -> None: ...


class PolicyReloader:
    def __init__(self, gateway: Reloadable, path: str, interval: float = 1.0, settle: float = SETTLE) -> None:
        self.gateway = gateway
        self.path = path
        self.interval = interval
        self.settle = settle
        self.seen: Stamp | None = self.stamp()
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.asked = 0  # admins' reloads (the console's button) waiting or running: the watch leaves them the change

    def stamp(self) -> Stamp | None:
        """What changes when the file does: its resolved path (a ConfigMap swaps a symlink), mtime, size, inode."""
        try:
            target = os.path.realpath(self.path)
            st = os.stat(target)
        except OSError:
            return None
        return target, st.st_mtime_ns, st.st_size, st.st_ino

    def read(self) -> tuple[Stamp | None, bytes | str]:
        """The file's stamp and bytes, or its stamp and why it cannot be read (a str)."""
        stamp = self.stamp()
        try:
            with open(self.path, "rb") as f:
                return stamp, f.read()
        except OSError as exc:
            return stamp, f"{self.path}: cannot read: {exc.strerror}"

    async def settled(self) -> tuple[Stamp | None, bytes | str] | None:
        """The file's stamp and bytes once it has been still for `settle`: two reads that far apart agree on both;
        None while it is still changing."""
        first = self.read()
        await asyncio.sleep(self.settle)
        return first if self.read() == first else None

    async def reload(self, why: str, by: AnyConnection | None = None) -> str:
        """Once the file has settled, validate it and, when its text changed and is valid, swap in its policy.
        The audit log records it as the admin of `by` (the console's button), else as the system (the file
        changed, SIGHUP). An admin's reload takes the change over from the watch: a watch that has settled and
        validated a text while an admin asked for a reload leaves it to the admin's, which then says "reloaded"
        and is audited as that admin's act (not "unchanged" because the watch applied it a moment before)."""
        if by is None:
            return await self._reload(why, by)
        self.asked += 1
        try:
            return await self._reload(why, by)
        finally:
            self.asked -= 1

    async def _reload(self, why: str, by: AnyConnection | None) -> str:
        async with self.lock:
            settled = await self.settled()
            if settled is None:  # still being written: the poll sees the next change and comes back
                log.info("policy reload (%s) deferred: %s is still being written", why, self.path)
                return CHANGING
            self.seen, content = settled
            if isinstance(content, str):
                return await self.refuse(why, content, by)
            version = version_of(content)
            live = self.gateway.snapshot
            if version == live.version:
                return UNCHANGED
            try:
                text = content.decode("utf-8")
            except UnicodeDecodeError as exc:
                return await self.refuse(why, f"{self.path}: not UTF-8 text (byte {exc.start})", by)
            try:
                policy = parse_policy(text, self.path)
                await check_backends(policy, self.gateway.resolver, unresolved_fatal=False, source=self.path)
            except PolicyError as exc:
                return await self.refuse(why, str(exc), by)
            if by is None and self.asked:  # an admin asked meanwhile: theirs applies it (no await from here on)
                self.seen = None  # looked at again on the next poll, should the admin's reload not apply it
                return UNCHANGED
            later = restart_needed(live.policy, policy)
            if later:  # never "ok" with a setting silently ignored
                return await self.refuse(why, f"{', '.join(later)} take effect only after a restart: restart the"
                                              f" gateway with this file, or revert those settings to reload the rest",
                                         by)
            apply_static_replicas(policy, self.gateway.replicas)
            self.gateway.install(compile_snapshot(policy, live, self.gateway.shared, version))
            self.gateway.discovery.sync(policy)
            self.gateway.live_metrics.reloaded(OK, version)
            changes = {"version": {"from": live.version, "to": version}, "why": why}
            if by is None:
                await self.gateway.audit.system("policy.reload", self.path, changes)
            else:
                await self.gateway.audit.act(by, "policy.reload", self.path, changes)
            log.info("policy reloaded (%s): version %s, %d models", why, version, len(policy.models))
            return OK

    async def refuse(self, why: str, problem: str, by: AnyConnection | None) -> str:
        """Keep the live policy, and say why: the metric, the log, and the audit log (the reason without any
        value it quotes from the file, policies/audit/log.py), as the admin of `by` or the system."""
        self.gateway.live_metrics.reloaded(INVALID)
        reason = scrub_text(problem)  # the loader may quote a value of the file: a URL's password, a provider key
        log.error("policy reload (%s) refused, version %s keeps serving: %s", why, self.gateway.snapshot.version,
                  reason)
        changes = {"why": why, "reason": reason, "serving": self.gateway.snapshot.version}
        if by is None:
            await self.gateway.audit.system("policy.reload_refused", self.path, changes)
        else:
            await self.gateway.audit.act(by, "policy.reload_refused", self.path, changes)
        return INVALID

    async def run(self) -> None:
        """Poll the file and wait for SIGHUP; reload on either (each waits for the file to settle)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread: no signal
            loop.add_signal_handler(signal.SIGHUP, self.wake.set)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await self.wake.wait()
                hup = self.wake.is_set()
                self.wake.clear()
                if hup or self.stamp() != self.seen:
                    await self.reload("SIGHUP" if hup else "file changed")
        finally:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGHUP)


def loaded_at_iso(snapshot: Snapshot) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(snapshot.loaded_at))
