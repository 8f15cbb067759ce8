"""The ledger in Redis, beside the keys: one hash per bucket, so N gateway replicas add into the same rows.

    {prefix}ledger:{<bucket start>}   hash   "<model>|<backend>|<key id>|<served>|<counter>" -> number

    {prefix}ledger:{<bucket start>}:busy:<model>|<backend>   bitmap   a bit per RESOLUTION seconds of the
                                                                  bucket: set while a call was in flight

Busy time is the union of every replica's calls' intervals, which sums cannot give (two replicas' calls
overlapping on a backend would count twice): each replica ORs the intervals it added into the bucket's bitmap
(BITOP OR, in a script, from a scratch key), and a report counts the set bits. Intervals round to the nearest
RESOLUTION, so a gap in the union is off by at most that much at either end.

The bucket start in braces is the key's hash tag: each bucket is one hash slot, and a flush writes each bucket
in one MULTI (its increments and the keys' expiry at the end of retention), so the layout works unchanged on
Redis Cluster. Names cannot hold "|" (the policy's name pattern and key ids leave it out). A report reads the
window's buckets with one pipelined HGETALL each, and a BITCOUNT per backend.
"""

from __future__ import annotations

import uuid

from policies.ledger.sums import BUSY, COUNTERS, Batch, Row
from policies.store.redis import RedisStore

SEP = "|"
RESOLUTION = 0.01  # seconds per bit of a busy bitmap: 6000 bits (750 bytes) for a minute
# KEYS: the bitmap, a scratch key of the same slot. ARGV: the bits to OR in, expire at. (A script: redis-py
# refuses BITOP in a Cluster pipeline; the scratch key never outlives it.)
OR_BITS = """
redis.call('SET', KEYS[2], ARGV[1])
redis.call('BITOP', 'OR', KEYS[1], KEYS[1], KEYS[2])
redis.call('DEL', KEYS[2])
redis.call('EXPIREAT', KEYS[1], ARGV[2])
return 1
"""


def bitmap(pieces: list[tuple[float, float]], bucket: int, bucket_seconds: int) -> bytes:
    """The intervals (unix seconds, inside the bucket) as bits from the bucket's start, Redis' order (bit 0 is the
    first byte's highest)."""
    size = round(bucket_seconds / RESOLUTION)
    bits = bytearray((size + 7) // 8)
    for start, end in pieces:
        lo, hi = max(0, round((start - bucket) / RESOLUTION)), min(size, round((end - bucket) / RESOLUTION))
        while lo < hi and lo % 8:
            bits[lo // 8] |= 0x80 >> (lo % 8)
            lo += 1
        full = (hi - lo) // 8
        bits[lo // 8:lo // 8 + full] = b"\xff" * full
        lo += full * 8
        while lo < hi:
            bits[lo // 8] |= 0x80 >> (lo % 8)
            lo += 1
    return bytes(bits).rstrip(b"\0")


class RedisLedger:
    def __init__(self, store: RedisStore, bucket_seconds: int) -> None:
        self.store = store  # its connection pool and its failure handling (`guard`)
        self.bucket_seconds = bucket_seconds

    def name(self, bucket: int) -> str:
        return f"{self.store.prefix}ledger:{{{bucket}}}"

    def busy_name(self, bucket: int, model: str, backend: str) -> str:
        return f"{self.name(bucket)}:busy:{model}{SEP}{backend}"

    async def add(self, batch: Batch, retention_seconds: float, now: float) -> None:
        by_bucket: dict[int, list[tuple[Row, list[float]]]] = {}
        for row, values in batch.rows.items():
            by_bucket.setdefault(row.bucket, []).append((row, values))
        busy: dict[int, list[tuple[str, bytes]]] = {}
        for (bucket, model, backend), pieces in batch.busy.items():
            bits = bitmap(pieces, bucket, self.bucket_seconds)
            if bits:
                busy.setdefault(bucket, []).append((self.busy_name(bucket, model, backend), bits))
        client = self.store.client
        for bucket in by_bucket.keys() | busy.keys():
            name = self.name(bucket)
            expire = int(bucket + retention_seconds)
            async with self.store.guard("ledger add"), client.pipeline(transaction=True) as pipe:
                for row, values in by_bucket.get(bucket, ()):
                    prefix = SEP.join(row[1:]) + SEP
                    for counter, value in zip(COUNTERS, values):
                        if value:
                            pipe.hincrbyfloat(name, prefix + counter, value)
                pipe.expireat(name, expire)
                for key, bits in busy.get(bucket, ()):
                    pipe.eval(OR_BITS, 2, key, f"{name}:or:{uuid.uuid4().hex}", bits, expire)
                await pipe.execute()

    async def read(self, since: float, until: float, key_id: str | None = None) -> list[tuple[Row, list[float]]]:
        size = self.bucket_seconds
        buckets = list(range(int(since) // size * size, int(until), size))
        buckets = [b for b in buckets if b >= since]
        out: list[tuple[Row, list[float]]] = []
        done = 0
        client = self.store.client
        for start in range(0, len(buckets), 500):
            chunk = buckets[start:start + 500]
            async with self.store.guard("ledger read"), client.pipeline(transaction=False) as pipe:
                for bucket in chunk:
                    pipe.hgetall(self.name(bucket))
                hashes = await pipe.execute()
            for bucket, fields in zip(chunk, hashes):
                rows: dict[Row, list[float]] = {}
                for field, value in fields.items():
                    model, backend, key, served, counter = field.split(SEP)
                    if key_id is not None and key != key_id:
                        continue
                    values = rows.setdefault(Row(bucket, model, backend, key, served), [0.0] * len(COUNTERS))
                    values[COUNTERS.index(counter)] = float(value)
                out.extend(rows.items())
            await self.union_busy([entry for entry in out[done:] if not entry[0].served])
            done = len(out)
        return out

    async def union_busy(self, time_rows: list[tuple[Row, list[float]]]) -> None:
        """Set each backend's busy time to its bitmap's: the union of every replica's (a row written before the
        bitmaps existed keeps its summed figure)."""
        if not time_rows:
            return
        async with self.store.guard("ledger read"), self.store.client.pipeline(transaction=False) as pipe:
            for row, _ in time_rows:
                pipe.bitcount(self.busy_name(row.bucket, row.model, row.backend))
            counts = await pipe.execute()
        for (_, values), count in zip(time_rows, counts):
            if count:
                values[BUSY] = count * RESOLUTION

    async def close(self) -> None:
        pass  # the pool belongs to the store
