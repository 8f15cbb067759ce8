"""The usage and cost ledger over time, and the own-vs-rent report drawn from it.

    sums.py      finished calls summed in memory per time bucket (busy time as a union of intervals)
    record.py    the observer: a pipeline step whose `leave` adds each finished call, flushed off the path
    sqlite.py    the ledger in the embedded SQLite file
    redis.py     the ledger in Redis (one hash per bucket: every write touches one hash slot)
    report.py    a window of the ledger -> utilisation, owned vs rented cost, burstiness, a recommendation
"""

from policies.ledger.sums import COUNTERS, Row, Sums

__all__ = ["COUNTERS", "Row", "Sums"]
