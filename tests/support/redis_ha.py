"""Redis set-ups that survive losing a server, built from Debian's redis-server and redis-sentinel on loopback:

- `SentinelSet`: a primary, two replicas and three sentinels (quorum 2) watching it as `mymaster`;
- `ClusterSet`: six cluster-enabled servers joined by `redis-cli --cluster create --cluster-replicas 1` into
  three primaries with one replica each.

Both expose `url` (the address form `policies.store.redis_client` reads), `primary()` (the server that holds
the primary role now; for a Cluster, the one holding a given key's slot), `promotions()` (how many replicas
were promoted so far, from the servers' own logs) and `close()`. Timeouts are short (a server is judged down
after 1 s, or `down_after_ms`) so a failover in a test takes seconds. Start-up waits on conditions (replicas
in sync, sentinels know each other, every slot served), never on a fixed sleep.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Self

import redis
from redis.crc import key_slot

from tests.support.needs import missing
from tests.support.redis_server import RedisServer

MASTER = "mymaster"
DOWN_AFTER_MS = 1000
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]  # a replica's first sync starts at once, not after 5 s


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if bindable(port) and bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class SentinelProcess(RedisServer):
    """One redis-sentinel watching `master_port`; it rewrites its own config file, so each has one."""

    def __init__(self, master_port: int, down_after_ms: int = DOWN_AFTER_MS, **kwargs) -> None:
        found = shutil.which("redis-sentinel")
        if not found:
            missing("redis-sentinel", "redis-setup")
        super().__init__(executable=found, **kwargs)
        self.master_port = master_port
        self.down_after_ms = down_after_ms

    def _argv(self) -> list[str]:
        conf = self.data_dir / "sentinel.conf"
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", "protected-mode no", "daemonize no",
            f"dir {self.data_dir}", f"logfile {self.log_path}",
            f"sentinel monitor {MASTER} 127.0.0.1 {self.master_port} 2",
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER} 5000",
            f"sentinel parallel-syncs {MASTER} 2",
        ]) + "\n")  # fmt: skip
        return [self.executable, str(conf)]


class ServerSet:
    """Processes started together and stopped together (all of them, even after a failed start)."""

    def __init__(self) -> None:
        self.servers: list[RedisServer] = []

    def start(self) -> None:
        raise NotImplementedError

    def processes(self) -> list[RedisServer]:
        return self.servers

    def primary(self, key: str) -> RedisServer:
        """The server that is the primary for `key` now."""
        raise NotImplementedError

    def client(self) -> redis.Redis | redis.RedisCluster:
        """A plain client of the set as it is now, for tests to look at what the gateways wrote."""
        raise NotImplementedError

    def caught_up(self) -> bool:
        """Every replica has acknowledged everything its primary wrote (asynchronous replication drained)."""
        for server in self.servers:
            if not server.running:
                continue
            info = redis.Redis(port=server.port).info("replication")
            if info.get("role") != "master":
                continue
            offsets = [v["offset"] for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if not offsets or any(o != info["master_repl_offset"] for o in offsets):
                return False
        return True

    def promotions(self) -> int:
        """How many times a replica became a primary since the start, as the servers log it."""
        raise NotImplementedError

    def logged(self, processes: list[RedisServer], pattern: str) -> list[str]:
        """The lines of these processes' logs that match `pattern`."""
        lines = []
        for process in processes:
            if process.log_path.exists():
                lines += [line for line in process.log_path.read_text(errors="replace").splitlines()
                          if re.search(pattern, line)]
        return lines

    def close(self) -> None:
        for process in self.processes():
            process.close()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SentinelSet(ServerSet):
    def __init__(self, down_after_ms: int = DOWN_AFTER_MS) -> None:
        super().__init__()
        self.sentinels: list[SentinelProcess] = []
        self.down_after_ms = down_after_ms

    def processes(self) -> list[RedisServer]:
        return [*self.sentinels, *self.servers]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{MASTER}/0"

    def start(self) -> None:
        primary = RedisServer(extra_args=FAST_SYNC)
        primary.start()
        self.servers.append(primary)
        for _ in range(2):
            replica = RedisServer(extra_args=[*FAST_SYNC, "--replicaof", "127.0.0.1", str(primary.port)])
            replica.start()
            self.servers.append(replica)
        for _ in range(3):
            sentinel = SentinelProcess(primary.port, self.down_after_ms)
            sentinel.start()
            self.sentinels.append(sentinel)
        self.wait_healthy(timeout=30)

    def wait_healthy(self, timeout: float) -> None:
        """Every live replica follows the current primary, and each sentinel knows the other two (so a
        failover can be authorized)."""
        wait_for(self.in_sync, timeout, "replicas in sync with the primary")
        wait_for(lambda: all(int(redis.Redis(port=s.port).sentinel_master(MASTER)["num-other-sentinels"]) >= 2
                             for s in self.sentinels if s.running), timeout, "sentinels to find each other")

    def in_sync(self) -> bool:
        primary = self.primary()
        replicas = [s for s in self.servers if s.running and s is not primary]
        return all(redis.Redis(port=r.port).info("replication").get("master_link_status") == "up"
                   and redis.Redis(port=r.port).info("replication").get("master_port") == primary.port
                   for r in replicas)

    def primary_port(self) -> int:
        """Where the sentinels say the primary is (the majority's answer)."""
        answers = []
        for s in self.sentinels:
            if s.running:
                try:
                    answers.append(int(redis.Redis(port=s.port).sentinel_get_master_addr_by_name(MASTER)[1]))
                except (redis.RedisError, OSError, TypeError):
                    continue
        return max(set(answers), key=answers.count)

    def primary(self, key: str = "") -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.primary_port(), decode_responses=True)

    def promotions(self) -> int:
        """Each sentinel logs `+switch-master NAME IP OLD IP NEW` for every failover it learns of."""
        switches = self.logged(self.sentinels, r"\+switch-master ")
        return len({tuple(line.split("+switch-master ", 1)[1].split()) for line in switches})



class ClusterSet(ServerSet):
    def __init__(self, primaries: int = 3, down_after_ms: int = DOWN_AFTER_MS) -> None:
        super().__init__()
        self.count = primaries * 2
        self.down_after_ms = down_after_ms

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self) -> None:
        cli = shutil.which("redis-cli")
        if not cli:
            missing("redis-cli", "redis-setup")
        for _ in range(self.count):
            server = RedisServer(port=cluster_port(), extra_args=[
                *FAST_SYNC, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.down_after_ms), "--cluster-replica-validity-factor", "0",
            ])  # fmt: skip
            server.start()
            self.servers.append(server)
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_healthy(timeout=60)

    def wait_healthy(self, timeout: float) -> None:
        live = [s for s in self.servers if s.running]
        wait_for(lambda: all(redis.Redis(port=s.port).execute_command("CLUSTER INFO")["cluster_state"] == "ok" for s in live),
                 timeout, "every cluster node to see all slots served")
        wait_for(lambda: len(self.replicas_in_sync()) == len(live) // 2, timeout, "cluster replicas in sync")

    def replicas_in_sync(self) -> list[RedisServer]:
        return [s for s in self.servers if s.running
                and redis.Redis(port=s.port).info("replication").get("master_link_status") == "up"]

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.any_live().port, decode_responses=True)

    def primary(self, key: str) -> RedisServer:
        """The server that holds the slot of `key` as primary now."""
        slot = key_slot(key.encode())
        for start, end, primary, *_ in redis.Redis(port=self.any_live().port).execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return next(s for s in self.servers if s.port == int(primary[1]))
        raise LookupError(f"no primary holds slot {slot}")

    def any_live(self) -> RedisServer:
        return next(s for s in self.servers if s.running)

    def promotions(self) -> int:
        """A replica that wins its election logs `Failover election won`."""
        return len(self.logged(self.servers, r"Failover election won"))

