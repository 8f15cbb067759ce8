"""The audit log: every admin act, who did it (the token's subject and issuer), when, from where, and what
changed (never a secret). One call records an act (`Audit.record`); each is also one structured log line
(logger `llm_gateway.audit`), so it can be shipped without reading the store.

    log.py       the event, the recorder, and the page a query returns
    sqlite.py    the log in the embedded SQLite file, a table of its own
    redis.py     the log in Redis, one sorted set shared by every gateway replica

Retention (admin.audit): events older than retention_days go, and only the newest max_events stay; both are
enforced at each write, so the log never outgrows its bound between two acts.
"""

from policies.audit.log import Actor, Audit, AuditEvent, AuditPage, AuditQuery, diff, scrub_text

__all__ = ["Actor", "Audit", "AuditEvent", "AuditPage", "AuditQuery", "diff", "scrub_text"]
