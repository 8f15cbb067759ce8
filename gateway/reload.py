"""Hot reload of the policy file: on a change of the file (polled) and on SIGHUP.

A Kubernetes ConfigMap mount changes by swapping a symlink (`..data`) to a new directory, so the file's own
path keeps its inode and mtime is unreliable through the link: the watch compares the resolved target, its
mtime and size each `interval`, and the text's hash decides whether anything changed. A change is read only
once it is stable, so a file written in pieces is never applied half-written: a new file (a rename, or a
ConfigMap's symlink swap, both atomic) must keep its stamp for `QUIET_RENAMED`, a file rewritten in place
(same inode) for `QUIET_IN_PLACE`, longer than the pauses of an editor or a script writing it piecewise; then
the text is read twice `RECHECK` apart and must hash the same. A new text is validated
completely (schema, then the egress rules) before anything changes; a file that fails is refused, the log names
the field, and the policy that was serving stays. A good one becomes a new snapshot (policies/snapshot.py)
and is swapped in at once; requests in flight finish under the one they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from litestar.connection import ASGIConnection

from policies.audit import scrub_text
from policies.config import PolicyError, parse_policy
from policies.egress import check_backends
from policies.snapshot import apply_static_replicas, compile_snapshot, restart_needed, version_of

log = logging.getLogger("gateway.reload")

OK, INVALID, UNCHANGED = "ok", "invalid", "unchanged"

QUIET_RENAMED = 0.2  # s a new inode must stay unchanged: a rename or symlink swap is atomic, this is a margin
QUIET_IN_PLACE = 3.0  # s a file rewritten in place must stay unchanged before it is read
RECHECK = 0.1  # s between the two reads whose hashes must agree


class PolicyReloader:
    def __init__(self, gateway, path: str, interval: float = 1.0) -> None:
        self.gateway = gateway
        self.path = path
        self.interval = interval
        self.seen: tuple | None = self.stamp()
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()

    def stamp(self) -> tuple | None:
        """What changes when the file does: its resolved path (a ConfigMap swaps a symlink), mtime and size."""
        try:
            target = os.path.realpath(self.path)
            st = os.stat(target)
        except OSError:
            return None
        return target, st.st_mtime_ns, st.st_size, st.st_ino

    async def reload(self, why: str, by: ASGIConnection | None = None) -> str:
        """Read, validate and, when the text changed and is valid, swap in the file's policy. The audit log
        records it as the admin of `by` (the console's button), else as the system (the file changed, SIGHUP)."""
        async with self.lock:
            try:
                text = Path(self.path).read_text(encoding="utf-8")
                await asyncio.sleep(RECHECK)
                again = Path(self.path).read_text(encoding="utf-8")
            except OSError as exc:
                return await self.refuse(why, f"{self.path}: cannot read: {exc.strerror}", by)
            if again != text:  # still being written: the poll sees the next change and comes back
                log.info("policy reload (%s) deferred: %s is still being written", why, self.path)
                return UNCHANGED
            version = version_of(text)
            live = self.gateway.snapshot
            if version == live.version:
                return UNCHANGED
            try:
                policy = parse_policy(text, self.path)
                await check_backends(policy, self.gateway.resolver, unresolved_fatal=False, source=self.path)
            except PolicyError as exc:
                return await self.refuse(why, str(exc), by)
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

    async def stable(self, stamp: tuple | None) -> bool:
        """Whether the file keeps `stamp` for its quiet time: short for a new inode, long for an in-place write."""
        seen = self.seen
        in_place = stamp is not None and seen is not None and (stamp[0], stamp[3]) == (seen[0], seen[3])
        await asyncio.sleep(QUIET_IN_PLACE if in_place else QUIET_RENAMED)
        return self.stamp() == stamp

    async def refuse(self, why: str, problem: str, by: ASGIConnection | None) -> str:
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
        """Poll the file and wait for SIGHUP; reload on either."""
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
                stamp = self.stamp()
                if hup or stamp != self.seen:
                    if not hup and not await self.stable(stamp):
                        continue  # changed again while settling: the next poll waits for it anew
                    self.seen = stamp
                    await self.reload("SIGHUP" if hup else "file changed")
        finally:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGHUP)


def loaded_at_iso(snapshot) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(snapshot.loaded_at))
