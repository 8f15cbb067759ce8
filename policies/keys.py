"""API keys: their format, how they are minted and hashed, and the record the store keeps for each.

A key reads `sk-<id>-<secret>`: `id` (16 hex characters) names the record and is safe to show; `secret`
(43 base62 characters, ~256 bits from `secrets`) is shown once at creation and never stored. The store keeps
SHA-256 of the whole key, which for a key of this entropy needs no salt or slow hash, and compares in constant
time. A rotated key keeps its previous hash until `previous_valid_until`, the grace period the admin chose.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import string
import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

PREFIX = "sk-"
ID_LENGTH = 16
SECRET_LENGTH = 43
ALPHABET = string.ascii_letters + string.digits
KEY_PATTERN = re.compile(rf"^sk-([0-9a-f]{{{ID_LENGTH}}})-([A-Za-z0-9]{{{SECRET_LENGTH}}})$")

CLASS_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"  # a priority class's name, as the policy spells them
TEAM_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"  # a team's name (policies/teams.py): lower case, one spelling each
DataPolicy = Literal["private_only", "allow_rented"]


def _cidr_pattern() -> str:
    """A network as `address[/prefix-length]`, IPv4 or IPv6: the form the admin API documents and accepts.

    Every string it matches is one ipaddress.ip_network accepts; it leaves out the netmask forms
    (10.0.0.0/255.0.0.0) and leading zeros, which ipaddress also takes.
    """
    octet = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
    v4 = rf"{octet}(\.{octet}){{3}}"
    h = r"[0-9a-fA-F]{1,4}"
    v6 = "|".join([  # the full form, each place the :: can stand, and an IPv4 tail
        rf"({h}:){{7}}{h}", rf"({h}:){{1,7}}:", rf"({h}:){{1,6}}:{h}", rf"({h}:){{1,5}}(:{h}){{1,2}}",
        rf"({h}:){{1,4}}(:{h}){{1,3}}", rf"({h}:){{1,3}}(:{h}){{1,4}}", rf"({h}:){{1,2}}(:{h}){{1,5}}",
        rf"{h}:(:{h}){{1,6}}", rf":((:{h}){{1,7}}|:)",
        rf"({h}:){{6}}{v4}", rf"({h}:){{1,5}}:{v4}", rf"::({h}:){{0,5}}{v4}",
    ])
    return rf"^({v4}(/(3[0-2]|[12]?[0-9]))?|({v6})(/(12[0-8]|1[01][0-9]|[1-9]?[0-9]))?)$"


CIDR_PATTERN = _cidr_pattern()
CIDR_FORM = re.compile(CIDR_PATTERN)


def _integral(value: object) -> object:
    """5.0 is the integer 5 (as in JSON Schema); strict validation then refuses true, "5" and 5.5."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Count = Annotated[int, BeforeValidator(_integral)]


# Upper bounds of a key's limits: far above any one key's real traffic (the benchmarks use them for limits that
# never bind), and low enough that every count the limiter keeps stays exact (Redis scripts compute in doubles,
# exact to 2**53) and a key's concurrency leases stay few.
MAX_RPM = 1_000_000_000
MAX_TPM = 1_000_000_000_000
MAX_CONCURRENT = 100_000


class KeyLimits(BaseModel):
    """Per-key limits, enforced by the rate-limit step; None means unlimited."""

    model_config = ConfigDict(extra="forbid")
    requests_per_minute: Count | None = Field(None, ge=1, le=MAX_RPM)
    tokens_per_minute: Count | None = Field(None, ge=1, le=MAX_TPM)
    max_concurrent: Count | None = Field(None, ge=1, le=MAX_CONCURRENT)


class KeyBudget(BaseModel):
    """What a key may spend per period (calendar day, ISO week or month, UTC), enforced by policies/budget.py."""

    model_config = ConfigDict(extra="forbid")
    max_rented_spend: float | None = Field(None, ge=0.0, le=1e9, description="currency units of rented tokens per"
                                           " period; once spent, see when_spent")
    max_tokens_per_period: Count | None = Field(None, ge=1, le=10**15, description="prompt + completion tokens"
                                                " per period, owned and rented; past it requests get 429 until"
                                                " the reset")
    period: Literal["day", "week", "month"] = "month"
    when_spent: Literal["owned_only", "reject"] = Field("owned_only", description="once max_rented_spend is spent:"
                                                        " stay on owned backends, or answer 429 until the reset")


class KeyRecord(BaseModel):
    """What the store keeps for one key. Never holds the key itself, only hashes of it."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(pattern=rf"^[0-9a-f]{{{ID_LENGTH}}}$")
    name: str = Field(min_length=1, max_length=200)
    owner: str | None = Field(None, max_length=200)
    team: str | None = Field(None, pattern=TEAM_NAME)  # the team it belongs to, if any: it narrows the team's
    models: list[str] | None = None  # None: every model (of its team, in a team)
    expires_at: float | None = None  # unix seconds
    revoked: bool = False
    data_policy: DataPolicy = "private_only"
    allowed_cidrs: list[str] | None = None
    limits: KeyLimits = KeyLimits()
    priority_class: str | None = Field(None, pattern=CLASS_NAME)  # None (or a class the policy lacks): default
    client_priority: bool = False  # the client may pick its class by header and send vLLM's `priority`
    budget: KeyBudget | None = None  # None: no budget
    created_at: float
    last_used_at: float | None = None
    hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    previous_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    previous_valid_until: float | None = None

    @field_validator("allowed_cidrs")
    @classmethod
    def valid_cidrs(cls, cidrs: list[str] | None) -> list[str] | None:
        return normalize_cidrs(cidrs)

    def matches(self, key: str, now: float) -> bool:
        """Whether `key` is this record's current key, or its previous one still within the grace period."""
        digest = hash_key(key)
        if hmac.compare_digest(digest, self.hash):
            return True
        if self.previous_hash and self.previous_valid_until and now < self.previous_valid_until:
            return hmac.compare_digest(digest, self.previous_hash)
        return False

    def usable(self, now: float) -> bool:
        return not self.revoked and (self.expires_at is None or now < self.expires_at)


def normalize_cidrs(cidrs: list[str] | None, strict_form: bool = False) -> list[str] | None:
    """Client networks in canonical form (10.1.2.3/8 -> 10.0.0.0/8); ValueError names the bad one.

    strict_form: accept only what CIDR_PATTERN matches (the admin API's documented form).
    """
    if cidrs is None:
        return None
    out = []
    for cidr in cidrs:
        if strict_form and not CIDR_FORM.match(cidr):
            raise ValueError(f"not a network in CIDR form (address/prefix-length): {cidr!r:.60}")
        try:
            out.append(str(ipaddress.ip_network(cidr, strict=False)))
        except ValueError:
            raise ValueError(f"not a network in CIDR form: {cidr!r:.60}") from None
    return out


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key_id() -> str:
    return secrets.token_hex(ID_LENGTH // 2)


def new_key(key_id: str) -> str:
    return f"{PREFIX}{key_id}-{''.join(secrets.choice(ALPHABET) for _ in range(SECRET_LENGTH))}"


def key_id_of(key: str) -> str | None:
    """The record id inside a well-formed key, or None for anything that is not one."""
    match = KEY_PATTERN.match(key)
    return match.group(1) if match else None


def now() -> float:
    return time.time()
