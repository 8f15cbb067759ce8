"""Processes the benchmark starts: each in its own process group, pinned to a core, always stopped.

Every process goes into one `Procs` registry; `Procs.stop_all` ends each group (SIGTERM, then SIGKILL after a
bounded wait) and runs from `finally`, from SIGTERM/SIGINT handlers and from atexit, so nothing outlives a
run that fails or is interrupted. CPU time and RSS are read from /proc for a process and all its descendants.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tree(self) -> list[int]:
        """This process and every descendant (read from /proc/*/stat parent links)."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def cpu_seconds(self) -> float:
        """utime + stime of the whole tree, in seconds."""
        total = 0
        for pid in self.tree():
            stat = _stat(pid)
            if stat is not None:
                total += int(stat[11]) + int(stat[12])  # fields 14 and 15 of /proc/<pid>/stat
        return total / CLK_TCK

    def rss_bytes(self) -> int:
        total = 0
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * PAGE
            except (OSError, IndexError, ValueError):
                pass
        return total

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (which may hold spaces): [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, cmd: list[str], core: int | None, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Proc:
        if core is not None:
            cmd = ["taskset", "-c", str(core), *cmd]
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, grace: float = 10.0) -> None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.popen.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc, signal.SIGKILL)  # also whatever the leader left behind in its group
        try:
            proc.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc, grace=5.0)


def _signal_group(proc: Proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group's id is the leader's pid (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def wait_until(check: Callable[[], bool], proc: Proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        if not proc.alive():
            raise RuntimeError(f"{what} exited with status {proc.popen.returncode}:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready after {timeout:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.2)


def http_ok(url: str, headers: dict[str, str] | None = None) -> Callable[[], bool]:
    return lambda: httpx.get(url, headers=headers, timeout=2, trust_env=False).status_code == 200
