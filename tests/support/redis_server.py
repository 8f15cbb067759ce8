"""A real `redis-server` process for tests: loopback only, a free port, its own temp data dir, AOF on.

Tests never use a system Redis on 6379: each run starts its own, so it can also be stopped and restarted
(same port, same data dir) to test outages and persistence. Without the binary it fails loudly, pointing at
scripts/setup_redis.sh: a skipped store test is not a passing one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from tests.support.needs import missing
from tests.support.servers import free_port


class RedisServer:
    """One redis-server child process: `start()`, `stop()`, `restart()`, `pause()`/`resume()`, or `with`."""

    def __init__(
        self,
        *,
        port: int | None = None,
        data_dir: str | Path | None = None,
        executable: str | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        extra_args: list[str] | tuple[str, ...] = (),
        password: str | None = None,
    ) -> None:
        found = executable or shutil.which("redis-server")
        if not found:
            missing("Debian's redis-server", "redis-setup")
        self.executable = found
        self._fixed_port = port is not None
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="redis-test-"))
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.password = password  # requirepass: clients must AUTH (the readiness probe does too)
        self.extra_args = list(extra_args) + (["--requirepass", password] if password else [])  # e.g. --replicaof
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _argv(self) -> list[str]:
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "no",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--loglevel", "notice",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        """Start and wait until it answers PING (after loading its AOF); bounded by start_timeout."""
        if self.running:
            return
        for attempt in range(3):
            self._proc = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return
            log = self._log_tail()
            self._kill()
            # Another process took the free port between choosing it and binding it: choose again.
            if "Address already in use" in log and not self._fixed_port and attempt < 2:
                self.port = free_port()
                continue
            raise RuntimeError(f"redis-server did not become ready on port {self.port}; log tail:\n{log}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            if self._answers_ping():
                return True
            time.sleep(0.02)
        return False

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                if self.password:
                    conn.sendall(b"AUTH %s\r\n" % self.password.encode())
                    if not conn.recv(64).startswith(b"+OK"):
                        return False
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")  # "-LOADING" while it reads the AOF
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM (Redis flushes the AOF and exits), wait; SIGKILL if it overstays stop_timeout."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self._proc.terminate()
            try:
                self._proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as when its node is lost (nothing flushed, no goodbye)."""
        self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(self.stop_timeout)
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers, like a hung server."""
        assert self._proc is not None, "redis-server is not running"
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None, "redis-server is not running"
        os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Stop and start again on the same port with the same data dir, so persisted data comes back."""
        self.stop()
        self.start()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop, and remove the data dir if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
