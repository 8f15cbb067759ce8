"""Which KV cache blocks each vLLM replica holds, from the events vLLM publishes (`--kv-events-config`).

vLLM sends every change to its prefix cache over ZMQ PUB as multipart messages `[topic, sequence (8 bytes, big
endian), msgpack batch]`; a batch is `[ts, [event, ...], dp_rank?]` and an event is a tagged struct: a map with
`type` (vLLM 0.32) or, from older versions, an array whose first item is the tag. `BlockStored` carries the new
blocks' hashes, the hash of the block before the first one (`parent_block_hash`, none at a prompt's start), their
token ids, the block size and the `medium` that holds them; `BlockRemoved` the hashes evicted and from which
medium; `AllBlocksCleared` nothing.

Media: GPU memory ("GPU", or none named), and where vLLM's offloading connectors copy blocks ("CPU",
"STORAGE"). A block's hash is the same in every medium, so the index keeps one table per medium: a block evicted
from GPU memory but still offloaded stays known, as the CPU's, and the scorer weighs it below a GPU block
(reloading it costs a transfer, less than a recompute). An offloaded store that names its blocks without their
tokens (the offloading connector's, unless `self_describing_kv_events` is on) marks a copy of the blocks the
index already knows; announcements of one hash repeated by overlapping offload chunks are counted, so it stays
until as many removals came.

The index keys a block by its *content*: the chain of token blocks from the prompt's start (`chain_key`), not by
vLLM's hash, whose function and seed depend on vLLM's version and settings (sha256 or xxhash, cbor or pickle,
PYTHONHASHSEED or a random seed). vLLM's hash is kept only to find a stored block's parent and to remove blocks.
So a gateway that tokenizes a prompt as vLLM does (policies/routing/precise_prefix.py) can look its blocks up
without knowing how that vLLM hashes.

Bounds: a message larger than `max_message_bytes` is refused by ZMQ (MAXMSGSIZE) and checked again here; msgpack
containers are limited by that size; an index holds at most `max_blocks` blocks, in all media (offloaded copies
go first, then the oldest stored); at most MAX_MEDIA media besides GPU; anything malformed or of an unknown type
is counted and skipped, never raised. Consistency: a sequence number that skips ahead means events were lost (the
index cannot know what was removed meanwhile) and one that goes back means vLLM restarted (its cache is empty):
both clear the index, as `AllBlocksCleared` does, and it refills from the next events. A replica that is down is
cleared too. Blocks vLLM already held when the subscription started, or that were stored during a gap, stay
unknown until vLLM stores them again.

Blind: an index that may know less than its vLLM holds. It is blind from a fresh subscription, a gap it could not
recover, a failed subscription or the replica down, until it has seen vLLM's cache from empty: the publisher's
first batch (sequence 0: vLLM started after the subscription), a restart seen from its first batch, or
`AllBlocksCleared`. `blind_since` says since when; what routing does then is the scorer's rule
(policies/routing/precise_prefix.py), which also bounds how long it waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from backends.replicas import DOWN, Replica
from backends.replicas import KVEventSource as KVEventSource  # a replica's setting, named here as before

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("gateway.kv_events")

ROOT = 0  # the chain key before a prompt's first block


def chain_key(parent: int, tokens: Iterable[int]) -> int:
    """The content key of a block: its tokens and its parent's key (so it stands for the whole prefix up to it).
    Tuples of ints hash the same in every Python process (PYTHONHASHSEED changes only str and bytes)."""
    return hash((parent, tuple(tokens)))


def prefix_keys(tokens: list[int], block_size: int, max_blocks: int) -> list[int]:
    """The content keys of a token sequence's full blocks, from its start (at most `max_blocks`)."""
    keys, key = [], ROOT
    for start in range(0, min(len(tokens) // block_size, max_blocks) * block_size, block_size):
        key = chain_key(key, tokens[start:start + block_size])
        keys.append(key)
    return keys


MAX_REPLAY = 10_000  # batches asked again for one gap (vLLM keeps its last buffer_steps, 10,000 by default)
REPLAY_SECONDS = 2.0  # the most one replay waits for vLLM's answer
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's marker after the last replayed batch
GPU = "GPU"  # vLLM's medium of a block in GPU memory (and of every block of a vLLM that names none)
MAX_MEDIA = 4  # media besides GPU an index tells apart (vLLM has CPU and STORAGE); a store in a fifth is refused


class Tier:
    """The blocks a replica holds in one medium other than GPU memory (vLLM's CPU offload, storage)."""

    __slots__ = ("blocks", "keys", "repeats")

    def __init__(self) -> None:
        self.blocks: dict[Any, int] = {}  # vLLM's block hash -> content key, oldest stored first
        self.keys: dict[int, int] = {}  # content key -> how many of this medium's blocks have it
        self.repeats: dict[Any, int] = {}  # a hash announced again while held (one chunk each): removals owed


class BlockIndex:
    """One replica's cached blocks by content key, fed with the raw messages of its event stream."""

    def __init__(self, max_blocks: int = 131072, max_message_bytes: int = 4 * 1024 * 1024,
                 replay: Callable[[int, int], list[list[bytes]]] | None = None, blind: bool = False) -> None:
        self.max_blocks = max_blocks
        self.replay = replay  # (start, end) -> the messages start..end-1 again, for a gap; None: a gap clears
        self.max_message_bytes = max_message_bytes
        self.by_hash: dict[Any, int] = {}  # vLLM's block hash -> content key, in GPU memory, oldest stored first
        self.offloaded: dict[str, Tier] = {}  # the blocks in each other medium (CPU, STORAGE), by its name
        self.keys: dict[int, int] = {}  # content key -> how many of vLLM's blocks have it, in any medium
        self.parents: dict[int, int] = {}  # content key -> the key it continues (ROOT: a prompt's first block)
        self.continued: dict[int, int] = {}  # content key -> how many held keys continue it
        self.block_size: int | None = None
        self.last_seq: int | None = None
        # since when (monotonic) it may know less than vLLM holds: a fresh subscription, a gap or a failed one,
        # the replica down; None: it has seen vLLM's cache from empty (sequence 0, AllBlocksCleared, a restart)
        self.blind_since: float | None = time.monotonic() if blind else None
        self.clears = 0  # AllBlocksCleared, gaps, restarts, replica down
        self.gaps = 0
        self.refused = 0  # messages or events skipped as malformed, oversized or unknown
        self.stored_total = 0  # blocks indexed
        self.removed_total = 0  # indexed blocks that vLLM evicted
        self.replayed = 0  # lost batches recovered from vLLM's replay buffer

    def __len__(self) -> int:  # (tuple(): a snapshot taken at once, as the subscriber's thread may add a medium)
        return len(self.by_hash) + sum(len(t.blocks) for t in tuple(self.offloaded.values()))

    def matched(self, keys: list[int]) -> int:
        """How many of a prompt's leading blocks (content keys, in order) this replica holds, in any medium."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def media(self, key: int) -> list[str]:
        """The media that hold a content key: GPU, and those it was offloaded to (CPU, STORAGE). Read from the
        event loop while the subscriber's thread writes: single lookups on a snapshot of the media."""
        counts = [(medium, tier.keys.get(key, 0)) for medium, tier in tuple(self.offloaded.items())]
        held = [medium for medium, n in counts if n]
        if self.keys.get(key, 0) > sum(n for _, n in counts):
            held.append(GPU)
        return held

    def weighed(self, keys: list[int], n: int, weight: Callable[[str], float]) -> float:
        """The first `n` of `keys` (all held), each counted as its best medium weighs: reloading a block from
        CPU memory costs a transfer, less than the recompute of a block nobody holds and more than nothing."""
        if not self.offloaded:
            return n * weight(GPU)
        return sum(max((weight(m) for m in self.media(key)), default=0.0) for key in keys[:n])

    def shared(self, key: int) -> bool:
        """The prefix up to this key is continued in more than one way here (one system prompt, many chats)."""
        return self.continued.get(key, 0) > 1

    def blind(self, window: float, now: float | None = None) -> bool:
        """It may hold less than vLLM does, and began to less than `window` seconds ago."""
        since = self.blind_since
        return since is not None and (time.monotonic() if now is None else now) - since < window

    def clear(self, why: str = "", blind: bool = True) -> None:
        """Forget every block. blind: vLLM may still hold them (a gap, a failure); False: it holds none either."""
        if len(self):
            log.info("KV block index cleared (%s): %d blocks forgotten", why or "cleared", len(self))
        self.by_hash.clear()
        self.offloaded.clear()
        self.keys.clear()
        self.parents.clear()
        self.continued.clear()
        self.clears += 1
        self.blind_since = time.monotonic() if blind else None

    def down(self, why: str) -> None:
        """The replica is down: what its vLLM holds when it is back is unknown until events say (a restart's
        sequence 0 does); blind from now, every time it is seen down."""
        if len(self):
            self.clear(why)
        self.blind_since = time.monotonic()

    def feed(self, frames: list[bytes], replaying: bool = False) -> None:
        """One ZMQ message. Never raises: what cannot be read is counted in `refused`. A sequence gap asks the
        replay source (if any) for the lost batches first and applies them in order; what it cannot recover
        clears the index."""
        if len(frames) != 3 or len(frames[1]) != 8 or sum(len(f) for f in frames) > self.max_message_bytes:
            self.refused += 1
            return
        import msgpack  # here, not at import: a gateway without kv_events runs without it (the GPU site's)

        try:
            batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)  # its lengths bounded by its size
        except Exception:  # msgpack raises several kinds for hostile input (ExtraData, FormatError, ValueError...)
            self.refused += 1
            return
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            self.refused += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if not replaying and self.replay is not None and last is not None and last + 1 < seq <= last + MAX_REPLAY:
            self.fill(last + 1, seq)
        self.sequence(seq)
        for event in batch[1]:
            self.apply(event)

    def fill(self, start: int, end: int) -> None:
        """Apply the batches start..end-1 from the replay source, in order (a missing one is a gap: it clears)."""
        try:
            assert self.replay is not None  # feed asks only an index with a replay source
            missing = self.replay(start, end)
        except Exception as exc:  # the replay socket failed: the gap clears the index as without one
            log.warning("KV events replay of %d..%d failed: %s", start, end - 1, exc)
            return
        for frames in missing:
            if len(frames) == 3 and len(frames[1]) == 8 and start <= int.from_bytes(frames[1], "big") < end:
                self.feed(frames, replaying=True)
        if self.last_seq == end - 1:  # recovered: a gap all the same, but nothing forgotten
            self.replayed += end - start
            self.gaps += 1

    def sequence(self, seq: int) -> None:
        last, self.last_seq = self.last_seq, seq
        if last is None:
            if seq == 0:  # the publisher's first batch: nothing was stored before it
                self.blind_since = None
            return
        if seq == last + 1:
            return
        if seq > last + 1:
            self.gaps += 1
            self.clear(f"events {last + 1}..{seq - 1} were lost")
        else:  # a new publisher: seen from its first batch, the index and its (empty) cache start together
            self.clear("the publisher restarted", blind=seq != 0)

    def apply(self, event: Any) -> None:
        kind, fields = _fields(event)
        try:
            if kind == "BlockStored":
                self.stored(fields)
            elif kind == "BlockRemoved":
                self.removed(fields.get("block_hashes"), _medium(fields.get("medium")))
            elif kind == "AllBlocksCleared":
                self.clear("vLLM cleared its cache", blind=False)
            else:
                self.refused += 1
        except (TypeError, ValueError):
            self.refused += 1

    def stored(self, f: dict[str, Any]) -> None:
        hashes, tokens, size, parent = f.get("block_hashes"), f.get("token_ids"), f.get("block_size"), f.get(
            "parent_block_hash")
        medium = _medium(f.get("medium"))
        if medium != GPU and medium not in self.offloaded and len(self.offloaded) >= MAX_MEDIA:
            raise ValueError("a medium beyond the ones an index tells apart")
        if isinstance(hashes, list) and tokens == []:
            self.copied(hashes, medium)
            return
        if not (isinstance(hashes, list) and isinstance(tokens, list) and type(size) is int and size > 0):
            raise ValueError("BlockStored without hashes, tokens or block size")
        extra = f.get("extra_keys")
        if f.get("lora_name") or f.get("lora_id") or f.get("group_idx") or (
                isinstance(extra, list) and any(e is not None for e in extra)):
            return  # an adapter's, a multimodal or salted block, or another cache group: no plain prompt matches it
        if len(tokens) != len(hashes) * size or not all(type(t) is int for t in tokens):
            raise ValueError("BlockStored whose tokens do not fill its blocks")
        if self.block_size != size:
            if medium != GPU and self.block_size is not None:
                return  # an offloading tier's own granularity: prompts are cut in GPU blocks
            if self.by_hash:
                self.clear("the block size changed")
            self.block_size = size
        if parent is None:
            key = ROOT
        else:
            found = self._key_of(parent)
            if found is None:
                return  # its parent was stored before we listened or during a gap: no prompt can reach it from here
            key = found
        for i, block_hash in enumerate(hashes):
            if not _hashable(block_hash):
                raise ValueError("a block hash that is neither an integer nor bytes")
            parent, key = key, chain_key(key, tokens[i * size:(i + 1) * size])
            self._add(block_hash, key, parent, medium)

    def copied(self, hashes: list[Any], medium: str) -> None:
        """A store that names blocks without their tokens (vLLM's offloading connector, unless its events are
        self-describing): a copy, in `medium`, of blocks known from elsewhere; the others cannot be placed."""
        for block_hash in hashes:
            key = self._key_of(block_hash)
            if key is not None:
                self._add(block_hash, key, self.parents.get(key, ROOT), medium)

    def _key_of(self, block_hash: Any) -> int | None:
        if not _hashable(block_hash):
            return None
        key = self.by_hash.get(block_hash)
        if key is None:
            key = next((t.blocks[block_hash] for t in self.offloaded.values() if block_hash in t.blocks), None)
        return key

    def _add(self, block_hash: Any, key: int, parent: int, medium: str = GPU) -> None:
        tier = None
        if medium == GPU:
            table = self.by_hash
        else:
            tier = self.offloaded.get(medium) or self.offloaded.setdefault(medium, Tier())
            table = tier.blocks
        old = table.pop(block_hash, None)
        if old is not None:
            if tier is not None and old == key:  # announced again (vLLM's offload chunks overlap): counted
                table[block_hash] = key
                tier.repeats[block_hash] = tier.repeats.get(block_hash, 0) + 1
                return
            self._unref(old, tier)
            if tier is not None:
                tier.repeats.pop(block_hash, None)
        table[block_hash] = key
        if tier is not None:
            tier.keys[key] = tier.keys.get(key, 0) + 1
        n = self.keys.get(key, 0)
        self.keys[key] = n + 1
        if n == 0:
            self.parents[key] = parent
            self.continued[parent] = self.continued.get(parent, 0) + 1
        self.stored_total += 1
        while len(self) > self.max_blocks:
            self._evict()

    def _evict(self) -> None:
        """The oldest copy in another medium goes first (it weighs less), then the oldest block in GPU memory."""
        tier = next((t for t in self.offloaded.values() if t.blocks), None)
        table = self.by_hash if tier is None else tier.blocks
        oldest = next(iter(table))
        self._unref(table.pop(oldest), tier)
        if tier is not None:
            tier.repeats.pop(oldest, None)

    def removed(self, hashes: Any, medium: str = GPU) -> None:
        """vLLM evicted these blocks from `medium`; a copy in another medium stays (a GPU block offloaded to CPU
        is then known as CPU's)."""
        if not isinstance(hashes, list):
            raise ValueError("BlockRemoved without hashes")
        tier = None if medium == GPU else self.offloaded.get(medium)
        if medium != GPU and tier is None:
            return
        table = self.by_hash if tier is None else tier.blocks
        for block_hash in hashes:
            if not _hashable(block_hash):
                continue
            if tier is not None and block_hash in tier.repeats:  # one of several announcements of it
                _less(tier.repeats, block_hash)
                continue
            key = table.pop(block_hash, None)
            if key is not None:
                self._unref(key, tier)
                self.removed_total += 1

    def _unref(self, key: int, tier: Tier | None = None) -> None:
        if tier is not None:
            _less(tier.keys, key)
        if _less(self.keys, key) > 0:
            return
        parent = self.parents.pop(key, None)
        if parent is not None:
            _less(self.continued, parent)


def _less(counts: dict[Any, int], key: Any) -> int:
    """One less of `key` in `counts`, gone at none; how many are left."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
    return left


# Field order of the array form (vLLM before tagged maps): the tag, then these.
_ORDER = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _fields(event: Any) -> tuple[str | None, dict[str, Any]]:
    if isinstance(event, dict):
        kind = event.get("type")
        return (kind if isinstance(kind, str) else None), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        order = _ORDER.get(event[0], ())
        return event[0], dict(zip(order, event[1:]))
    return None, {}


def _hashable(value: Any) -> bool:
    return type(value) is int or type(value) is bytes


def _medium(value: Any) -> str:
    """vLLM's medium of a block: GPU, CPU, STORAGE (any case; none: GPU, as vLLM before media reported)."""
    if value is None:
        return GPU
    if not isinstance(value, str) or not 0 < len(value) <= 32:
        raise ValueError("a medium that is not a short name")
    return value.upper()


class Subscriber:
    """One replica's SUB socket, read in a thread of its own so that decoding a burst of events (a GPU server
    stores thousands of blocks a second) never holds the event loop that serves requests; it feeds the index
    until stopped. A socket error closes it, clears the index and opens a new one after a backoff (ZMQ itself
    reconnects a dropped TCP connection). The index is written only here; the scorer reads it from the event
    loop (single dict lookups, atomic under the GIL)."""

    POLL_MS = 200  # how often a quiet socket checks whether to stop or whether its replica is down

    def __init__(self, replica: Replica, source: KVEventSource, index: BlockIndex,
                 context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.replica, self.source, self.index, self.context = replica, source, index, context
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"kv-events-{replica.name}", daemon=True)

    def socket(self) -> zmq.Socket[bytes]:
        import zmq

        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.source.max_message_bytes)  # a larger message drops the connection
        sock.setsockopt(zmq.RCVHWM, 10_000)  # messages queued here; beyond, ZMQ drops (a gap: the index clears)
        sock.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        if "[" in self.source.endpoint:  # an IPv6 address (a discovered pod's)
            sock.setsockopt(zmq.IPV6, 1)
        if self.source.bind:
            sock.bind(self.source.endpoint)
        else:
            sock.connect(self.source.endpoint)
        return sock

    def replay(self, start: int, end: int) -> list[list[bytes]]:
        """The batches start..end-1 again from vLLM's replay endpoint (a DEALER to its ROUTER), bounded in count,
        size and time; fewer when vLLM no longer has them."""
        import zmq

        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.source.max_message_bytes)
        endpoint = self.source.replay or ""
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[list[bytes]] = []
            deadline = time.monotonic() + REPLAY_SECONDS
            while len(out) < end - start:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    break
                frames = sock.recv_multipart()  # [b"", topic, seq, payload], or [b"", b"", END_SEQ, b""]
                if len(frames) != 4 or frames[2] == END_SEQ or int.from_bytes(frames[2], "big") >= end:
                    break
                out.append(frames[1:])
            return out
        finally:
            sock.close(linger=0)

    def run(self) -> None:
        import zmq

        backoff, name = 0.5, self.replica.name
        while not self.stop.is_set():
            sock = None
            try:
                sock = self.socket()
                log.info("KV events of %s: %s %s", name, "bound to" if self.source.bind else "connected to",
                         self.source.endpoint)
                while not self.stop.is_set():
                    if sock.poll(self.POLL_MS):
                        self.index.feed(sock.recv_multipart())
                        backoff = 0.5
                    if self.replica.state == DOWN:
                        self.index.down(f"backend {name} is down")
            except zmq.ZMQError as exc:
                if self.stop.is_set():
                    break
                log.warning("KV events of %s at %s: %s; retrying in %.1f s", name, self.source.endpoint, exc, backoff)
                self.index.clear("the subscription failed")
                self.index.last_seq = None
            finally:
                if sock is not None:
                    sock.close(linger=0)
            self.stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)


class Subscribers:
    """A subscriber for every replica that has a `kv_events` source (static, or found by discovery), kept in step
    with the live replica set: a new replica gets one (and a fresh, blind index), a gone one (or one whose source
    changed) has its own stopped, its socket closed and its index dropped. A replica that stays (a reload, a
    discovery event that lists it again) keeps its subscriber and index. At most one subscriber per replica name."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]], interval: float = 1.0) -> None:
        self.replicas = replicas
        self.interval = interval
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None  # once a replica has a source
        self.running: dict[str, Subscriber] = {}
        self.stopping: list[Subscriber] = []  # stopped, their threads not yet seen to end (each within a poll)

    def sync(self) -> None:
        wanted = {r.name: r for r in self.replicas() if r.kv_events is not None and not r.draining}
        self.stopping = [sub for sub in self.stopping if sub.thread.is_alive()]
        if self.context is None:
            if not wanted:
                return
            import zmq

            self.context = zmq.Context()
        for name, sub in list(self.running.items()):
            if wanted.get(name) is not sub.replica or sub.replica.kv_events != sub.source:
                self.stop(name)
        for name, replica in wanted.items():
            if name in self.running:
                continue
            # a fresh index for a fresh subscription: what the old one knew may have changed unseen meanwhile;
            # blind until it has seen vLLM's cache from empty or for a while (policies/routing/precise_prefix.py)
            source = replica.kv_events
            assert source is not None  # as `wanted` was chosen
            index = replica.kv_index = BlockIndex(source.max_blocks, source.max_message_bytes, blind=True)
            sub = self.running[name] = Subscriber(replica, source, index, self.context)
            if source.replay:
                index.replay = sub.replay
            sub.thread.start()

    def stop(self, name: str) -> None:
        """Stop a replica's subscriber: its thread closes the socket within a poll; the index it fed is dropped."""
        sub = self.running.pop(name)
        sub.stop.set()
        if sub.replica.kv_index is sub.index:
            sub.replica.kv_index = None
        self.stopping.append(sub)
        log.info("KV events of %s: unsubscribed from %s", name, sub.source.endpoint)

    async def run(self) -> None:
        try:
            while True:
                self.sync()
                await asyncio.sleep(self.interval)
        finally:
            subs = list(self.running.values()) + self.stopping
            self.running.clear()
            self.stopping = []
            for sub in subs:
                sub.stop.set()
            for sub in subs:  # each notices within a poll
                await asyncio.to_thread(sub.thread.join, 5)
            if self.context is not None:
                self.context.destroy(linger=0)
                self.context = None
