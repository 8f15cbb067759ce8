"""An admin act as one event, the recorder every admin route calls, and the query that reads them back."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from pydantic import BaseModel, ConfigDict, Field

from policies.config.audit import AuditSettings
from policies.store import StoreError

log = logging.getLogger("llm_gateway.audit")

MAX_CHANGES_BYTES = 16 * 1024  # what one event keeps of its changes; a larger change is cut and says so
MAX_TEXT = 500  # characters of an actor, issuer, action or target
# never kept, whatever a caller passes: secrets and their hashes
SECRET_FIELDS = frozenset({"key", "hash", "previous_hash", "secret", "token", "password", "authorization"})
MAX_TEXT_CHANGE = 2000  # characters of a free text kept in an event's changes (a refused reload's reason)
QUOTED = re.compile(r" \(got .*\)$", re.MULTILINE)  # policies/config/loader.py quotes the value it refused
SECRETISH = (
    (re.compile(r"(://[^/\s:@]*:)[^@\s/]+@"), r"\1[redacted]@"),  # a password in a URL's userinfo
    (re.compile(r"(?i)\b(bearer|basic)\s+\S+"), r"\1 [redacted]"),
    # a quoted line of the file that sets a secret-named field (`  api_key: sk-...`, `password=...`)
    (re.compile(r"(?im)^(\s*-?\s*['\"]?[\w-]*(?:key|token|secret|password|authorization)[\w-]*['\"]?\s*[:=]\s*)\S.*$"),
     r"\1[redacted]"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), "sk-[redacted]"),
    # any long token-like run of letters and digits both (a path is cut at each slash, a name at each dot)
    (re.compile(r"(?<![A-Za-z0-9+_=-])(?=[A-Za-z0-9+_=-]*[0-9])(?=[A-Za-z0-9+_=-]*[A-Za-z])[A-Za-z0-9+_=-]{32,}"),
     "[redacted]"),
)


@dataclass(frozen=True)
class Actor:
    """Who acted: the admin token's subject and issuer, its role (and team), and the client's address."""

    subject: str
    issuer: str
    role: str
    team: str | None = None
    address: str | None = None


class AuditEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="time-ordered: a later event has a greater id")
    at: float = Field(description="unix seconds")
    actor: str = Field(description="the admin token's subject (sub); gateway for its own acts")
    issuer: str = Field(description="the admin token's issuer (iss)")
    role: str
    team: str | None = None
    address: str | None = Field(description="the client's address (X-Forwarded-For only from trusted proxies)")
    action: str = Field(description="e.g. key.create, key.update, key.rotate, key.revoke, variants.weights,"
                                    " policy.reload, policy.reload_refused")
    target: str = Field(description="what was acted on: a key id, a model, the policy file")
    changes: dict[str, Any] = Field(description="what changed (new values; never a secret)")


class AuditQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    actor: str | None = None
    action: str | None = None
    target: str | None = None
    since: float | None = None  # at >= since
    until: float | None = None  # at < until
    before: str | None = None  # the page after this id (the `next` of the previous page)
    limit: int = 100

    def matches(self, event: AuditEvent) -> bool:
        return ((self.actor is None or event.actor == self.actor)
                and (self.action is None or event.action == self.action)
                and (self.target is None or event.target == self.target)
                and (self.since is None or event.at >= self.since)
                and (self.until is None or event.at < self.until)
                and (self.before is None or event.id < self.before))


class AuditPage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    events: list[AuditEvent] = Field(description="newest first")
    next: str | None = Field(description="pass as `before` for the next (older) page; null: no more")


class AuditLog(Protocol):
    """Where events are kept: one implementation per store kind."""

    async def add(self, event: AuditEvent, settings: AuditSettings) -> None:
        """Keep the event, then drop what retention no longer keeps."""

    async def query(self, query: AuditQuery) -> AuditPage:
        """The newest events matching `query`, at most query.limit."""

    async def close(self) -> None:
        """Release what the log holds (nothing when it shares the store's connections)."""


def new_id(at: float) -> str:
    """Microseconds since the epoch, then random bits: ids sort as time does, and two replicas never collide."""
    return f"{int(at * 1_000_000):017d}-{os.urandom(4).hex()}"


def scrub(changes: dict[str, Any]) -> dict[str, Any]:
    """The changes without any secret, bounded in size."""
    clean = {k: scrub(v) if isinstance(v, dict) else v for k, v in changes.items() if k not in SECRET_FIELDS}
    if len(orjson.dumps(clean, default=str)) > MAX_CHANGES_BYTES:
        return {"fields": sorted(clean)[:100], "truncated": True}
    return clean


def scrub_text(text: str) -> str:
    """A free text for an event (an error that may quote a file): no quoted value, nothing that reads like a
    secret (a URL's password, a bearer token, a quoted `api_key: ...` line, a long token-like run), at most
    MAX_TEXT_CHANGE characters."""
    text = QUOTED.sub("", text)
    for pattern, replacement in SECRETISH:
        text = pattern.sub(replacement, text)
    return text if len(text) <= MAX_TEXT_CHANGE else text[:MAX_TEXT_CHANGE] + " [truncated]"


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """{field: {"from": old, "to": new}} for each field whose value differs."""
    return {k: {"from": before.get(k), "to": after.get(k)} for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)}


class Audit:
    """Records admin acts: `await audit.record(actor, "key.revoke", key_id, {"revoked": True})`."""

    def __init__(self, store: AuditLog, settings: AuditSettings,
                 on_error: Callable[[str], None] = lambda _why: None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.settings = settings
        self.on_error = on_error
        self.clock = clock

    async def record(self, actor: Actor, action: str, target: str, changes: dict[str, Any] | None = None) -> None:
        """Log the act as one JSON line, then keep it in the store. A store that fails is counted and logged,
        never raised: the act has happened, and its log line is already written."""
        at = self.clock()
        event = AuditEvent(id=new_id(at), at=at, actor=actor.subject[:MAX_TEXT], issuer=actor.issuer[:MAX_TEXT],
                           role=actor.role, team=actor.team, address=actor.address, action=action[:MAX_TEXT],
                           target=target[:MAX_TEXT], changes=scrub(changes or {}))
        log.info(orjson.dumps({"audit": event.model_dump()}, default=str).decode())
        try:
            await self.store.add(event, self.settings)
        except StoreError as exc:
            self.on_error("audit")
            log.error("audit event %s not stored: %s", event.id, exc)

    async def query(self, query: AuditQuery) -> AuditPage:
        return await self.store.query(query)
