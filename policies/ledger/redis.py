"""The ledger in Redis, beside the keys: one hash per bucket, so N gateway replicas add into the same rows.

    {prefix}ledger:{<bucket start>}   hash   "<model>|<backend>|<key id>|<served>|<counter>" -> number

The bucket start in braces is the key's hash tag: each bucket is one hash slot, and a flush writes each bucket
in one MULTI (its increments and the hash's expiry at the end of retention), so the layout works unchanged on
Redis Cluster. Names cannot hold "|" (the policy's name pattern and key ids leave it out). A report reads the
window's buckets with one pipelined HGETALL each.
"""

from __future__ import annotations

from policies.ledger.sums import COUNTERS, Row

SEP = "|"


class RedisLedger:
    def __init__(self, store, bucket_seconds: int) -> None:
        self.store = store  # a RedisStore: its connection pool and its failure handling (`guard`)
        self.bucket_seconds = bucket_seconds

    def name(self, bucket: int) -> str:
        return f"{self.store.prefix}ledger:{{{bucket}}}"

    async def add(self, rows: dict[Row, list[float]], retention_seconds: float, now: float) -> None:
        by_bucket: dict[int, list[tuple[Row, list[float]]]] = {}
        for row, values in rows.items():
            by_bucket.setdefault(row.bucket, []).append((row, values))
        client = self.store.client
        for bucket, entries in by_bucket.items():
            name = self.name(bucket)
            async with self.store.guard("ledger add"), client.pipeline(transaction=True) as pipe:
                for row, values in entries:
                    prefix = SEP.join(row[1:]) + SEP
                    for counter, value in zip(COUNTERS, values):
                        if value:
                            pipe.hincrbyfloat(name, prefix + counter, value)
                pipe.expireat(name, int(bucket + retention_seconds))
                await pipe.execute()

    async def read(self, since: float, until: float, key_id: str | None = None) -> list[tuple[Row, list[float]]]:
        size = self.bucket_seconds
        buckets = list(range(int(since) // size * size, int(until), size))
        buckets = [b for b in buckets if b >= since]
        out: list[tuple[Row, list[float]]] = []
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
        return out

    async def close(self) -> None:
        pass  # the pool belongs to the store
