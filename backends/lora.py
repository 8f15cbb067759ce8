"""LoRA adapters on owned vLLM replicas: which ones each replica holds, and loading them there on demand.

What a replica holds is learned from vLLM itself: its /v1/models lists every adapter it serves, with `parent`
set (`refresh`, on an interval, and after any load or unload). A restarted vLLM lists none, so the gateway
never trusts its own memory for long. Between two reads it keeps what it did itself (a load, an unload) and the
order in which adapters were last used, for the least-recently-used unload.

`ensure(replica, adapter)` makes sure the replica holds the adapter before a request is sent there:
- at most one load of one adapter on one replica at a time (single-flight: every request that needs it waits
  on that one load, and gets its outcome);
- loads of different adapters on one replica take turns (each within `load_timeout`), so they never both
  count one free slot;
- when the replica already holds `max_loras` adapters, the least recently used one that no request of this
  gateway is using is unloaded first (when every one is in use, the load goes ahead and vLLM queues the extra
  adapter's requests until a slot frees: no request is refused for it);
- a load or unload is one POST of vLLM's run-time API (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), bounded in
  time (`load_timeout`) and in the size of its answer; a refusal raises LoadFailed with vLLM's own words.

Nothing here marks a replica unhealthy: an adapter that cannot load is the adapter's fault, not the replica's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

from backends.http1 import Client, UpstreamError
from backends.replica_state import Held
from backends.replicas import Replica

log = logging.getLogger("gateway.lora")

MESSAGE_CHARS = 300  # of vLLM's answer, quoted in an error


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    """An adapter as vLLM knows it: its lora_name and the path it loads from (None: never loaded by us)."""

    lora_name: str
    path: str | None


@dataclass(frozen=True, slots=True)
class LoraTimings:
    max_loras: int = 1
    load_timeout: float = 30.0
    max_answer_bytes: int = 1024 * 1024


class LoadFailed(Exception):
    """vLLM refused to load the adapter (missing files, rank above its --max-lora-rank...), or did not answer
    in time (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def held(replica: Replica) -> Held:
    """The replica's adapters (made on first use; kept on the replica across policy reloads)."""
    if replica.lora is None:
        replica.lora = Held()
    return replica.lora


def listed_adapters(body: bytes) -> dict[str, str | None] | None:
    """The adapters a vLLM /v1/models answer lists (entries with a `parent`), each with its `root` (the path it
    was loaded from); None: not such an answer."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    return {e["id"]: e["root"] if isinstance(e.get("root"), str) and e["root"] else None for e in entries
            if isinstance(e, dict) and isinstance(e.get("id"), str) and e.get("parent") is not None}


class LoraAdapters:
    """Loads, unloads and watches the adapters of the replicas `replicas()` returns (those of models with LoRA)."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]], timings: Callable[[Replica], LoraTimings],
                 on_event: Callable[[Replica, str, str], None] | None = None) -> None:
        self.replicas = replicas
        self.timings = timings  # the replica's settings, from the live policy
        self.on_event = on_event or (lambda replica, adapter, event: None)  # "load", "unload", "load_failed"

    # -- what a request does ------------------------------------------------------------------------------

    async def ensure(self, client: Client, replica: Replica, adapter: AdapterTarget) -> bool:
        """Return once `replica` holds `adapter` (True when this call waited for a load); raises LoadFailed."""
        state = held(replica)
        if state.holds(adapter.lora_name):
            state.touch(adapter.lora_name)
            return False
        if adapter.path is None:
            raise LoadFailed(f"replica {replica.name} does not serve adapter {adapter.lora_name} and the policy "
                             "gives no path to load it from")
        name = adapter.lora_name
        flight = state.loading.get(name)
        if flight is None:  # a task of its own: a caller that goes away (its client left) leaves it to the others
            flight = asyncio.get_running_loop().create_task(self._load(client, replica, state, adapter))
            state.loading[name] = flight
            flight.add_done_callback(lambda done: _landed(state, name, done))
        await asyncio.shield(flight)
        return True

    def using(self, replica: Replica, name: str) -> None:
        state = held(replica)
        state.in_use[name] = state.in_use.get(name, 0) + 1
        state.touch(name)

    def done(self, replica: Replica, name: str) -> None:
        state = held(replica)
        left = state.in_use.get(name, 0) - 1
        if left > 0:
            state.in_use[name] = left
        else:
            state.in_use.pop(name, None)

    def forget(self, replica: Replica, name: str) -> None:
        """vLLM said it does not know the adapter (it restarted, or someone unloaded it)."""
        held(replica).loaded.pop(name, None)

    # -- loading and unloading -----------------------------------------------------------------------------

    async def _load(self, client: Client, replica: Replica, state: Held, adapter: AdapterTarget) -> None:
        timings = self.timings(replica)
        state.max_loras = timings.max_loras
        deadline = time.monotonic() + timings.load_timeout
        try:  # one load at a time on one replica, so that two loads do not both count the same free slot
            async with asyncio.timeout(timings.load_timeout):
                await state.turn.acquire()
        except TimeoutError:
            raise LoadFailed(f"loading adapter {adapter.lora_name} on replica {replica.name} waited for its other "
                             f"loads longer than lora.load_timeout ({timings.load_timeout:g} s)", timed_out=True) \
                from None
        try:
            await self._load_now(client, replica, state, adapter, timings, deadline)
        finally:
            state.turn.release()

    async def _load_now(self, client: Client, replica: Replica, state: Held, adapter: AdapterTarget,
                        timings: LoraTimings, deadline: float) -> None:
        while len(state.loaded) >= timings.max_loras:
            victim = next((n for n in state.loaded if not state.in_use.get(n) and n not in state.loading), None)
            if victim is None:
                break  # every held adapter is in use: vLLM queues the extra adapter's requests
            await self._unload(client, replica, state, victim, deadline)
        status, text = await self._post(client, replica, "/v1/load_lora_adapter",
                                        {"lora_name": adapter.lora_name, "lora_path": adapter.path}, deadline,
                                        f"loading adapter {adapter.lora_name}")
        if status != 200 and not (status == 400 and "already been loaded" in text):
            self.on_event(replica, adapter.lora_name, "load_failed")
            raise LoadFailed(f"replica {replica.name} could not load adapter {adapter.lora_name} "
                             f"(HTTP {status}): {_message(text)}")
        state.loaded[adapter.lora_name] = time.monotonic()
        state.changed_at[adapter.lora_name] = time.monotonic()
        state.loads += 1
        self.on_event(replica, adapter.lora_name, "load")
        log.info("loaded adapter %s on replica %s", adapter.lora_name, replica.name)

    async def _unload(self, client: Client, replica: Replica, state: Held, name: str, deadline: float) -> None:
        state.loaded.pop(name, None)
        state.changed_at[name] = time.monotonic()
        status, text = await self._post(client, replica, "/v1/unload_lora_adapter", {"lora_name": name}, deadline,
                                        f"unloading adapter {name}")
        if status not in (200, 404):  # 404: it was gone already
            log.warning("replica %s could not unload adapter %s (HTTP %s): %s", replica.name, name, status,
                        _message(text))
            return
        state.unloads += 1
        self.on_event(replica, name, "unload")
        log.info("unloaded adapter %s from replica %s (least recently used)", name, replica.name)

    async def _post(self, client: Client, replica: Replica, path: str, body: dict[str, str | None], deadline: float,
                    what: str) -> tuple[int, str]:
        timings = self.timings(replica)
        upstream = replica.upstream or replica.connect(client)
        try:
            async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                response = await upstream.open(path, orjson.dumps(body), f"lora-{int(time.time() * 1000)}")
                try:
                    raw = await response.read(timings.max_answer_bytes, "lora.max_answer_bytes")
                finally:
                    response.close()
        except TimeoutError:
            raise LoadFailed(f"{what} on replica {replica.name} took longer than lora.load_timeout "
                             f"({timings.load_timeout:g} s)", timed_out=True) from None
        except UpstreamError as exc:
            raise LoadFailed(f"{what} on replica {replica.name} failed: {exc}") from None
        return response.status, raw.decode("utf-8", "replace")

    # -- what vLLM says it holds ---------------------------------------------------------------------------

    async def refresh(self, client: Client, replica: Replica) -> None:
        """Read the adapters the replica holds from its /v1/models; one changed by us while the read was under
        way keeps our view. A failed read changes nothing (the health check judges the replica)."""
        timings = self.timings(replica)
        state = held(replica)
        state.max_loras = timings.max_loras
        started = time.monotonic()
        try:
            status, body = await client.get(f"{replica.url}/v1/models", timeout=min(timings.load_timeout, 10.0),
                                            max_bytes=timings.max_answer_bytes, limit_name="lora.max_answer_bytes")
        except UpstreamError:
            return
        names = listed_adapters(body) if status == 200 else None
        if names is None:
            return
        ours = {n for n, at in state.changed_at.items() if at >= started}
        kept = OrderedDict((n, at) for n, at in state.loaded.items() if n in names or n in ours)
        for name in names:
            if name not in kept and not (name in ours and name not in state.loaded):
                kept[name] = 0.0
                kept.move_to_end(name, last=False)  # one we did not use yet: the first to go
        state.loaded = kept
        state.roots = {n: root for n, root in names.items() if root is not None}
        state.known = True
        cutoff = time.monotonic() - 3600
        state.changed_at = {n: at for n, at in state.changed_at.items() if at > cutoff}

    def found(self, model: str) -> dict[str, AdapterTarget]:
        """The adapters the replicas of `model` say they hold, with the path to load each elsewhere (for
        `lora.discover`): from the last reads of their /v1/models."""
        out: dict[str, AdapterTarget] = {}
        for replica in self.replicas():
            if replica.model == model and replica.lora is not None and not replica.draining:
                for name in replica.lora.loaded:
                    if name not in out or out[name].path is None:
                        out[name] = AdapterTarget(name, replica.lora.roots.get(name))
        return out

    async def refresh_all(self, client: Client) -> None:
        owned = [r for r in self.replicas() if r.rented is None and r.routable]
        await asyncio.gather(*(self.refresh(client, r) for r in owned))

    async def run(self, client: Client, interval: Callable[[], float]) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.refresh_all(client)
            except Exception:  # a bug: say so, and keep watching
                log.exception("could not read the replicas' LoRA adapters")
            await asyncio.sleep(max(0.1, interval() - (time.monotonic() - started)))


def _landed(state: Held, name: str, flight: asyncio.Task[None]) -> None:
    if state.loading.get(name) is flight:
        del state.loading[name]
    if not flight.cancelled():
        flight.exception()  # retrieved: the callers got it; no "never retrieved" warning when none waited


def _message(text: str) -> str:
    """vLLM's error message out of its JSON answer (or the text itself), shortened."""
    try:
        data = orjson.loads(text)
        message = data["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = text
    return str(message).replace("\n", " ")[:MESSAGE_CHARS]
