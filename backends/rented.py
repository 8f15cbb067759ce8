"""Rented providers: OpenAI-compatible APIs the gateway may spill bursts to, the only declared public egress.

Each provider's API key comes from the environment variable the policy file names, never from the file, and
is sent only to that provider. A provider whose key is missing is disabled (logged by name, not by value).
For routing, every (provider, model) pair is a pseudo-replica: no cap, no health checks, never retried.

A provider may quote back the Authorization it received (in an error message, a header, a stream's error
event): `scrub` replaces every provider key, in each form it may be quoted in, by a fixed marker. The proxy runs
a rented answer's head, body and stream events through it before anything reaches a client, a log or a span;
owned replicas never get a provider key, so their answers skip it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from urllib.parse import quote

import orjson

from backends.http1 import Client
from backends.replicas import UP, Replica
from backends.upstream import Upstream

log = logging.getLogger("gateway.rented")
REDACTED = b"[redacted]"
PERCENT = re.compile(rb"%[0-9A-F]{2}")


def quoted_forms(secret: str) -> tuple[bytes, ...]:
    """The ways an answer may spell `secret` (alone or inside `Bearer <key>`): as it is, JSON-escaped (`\\"`,
    `\\\\` and control characters; `/` as `\\/`; every character as `\\u00XX`), or percent-encoded; longest
    first."""
    raw = secret.encode()
    forms = {raw, orjson.dumps(secret)[1:-1], orjson.dumps(secret)[1:-1].replace(b"/", b"\\/"),
             quote(secret, safe="").encode(), quote(secret).encode()}
    for hex_form in ("\\u{:04x}", "\\u{:04X}"):
        forms.add("".join(hex_form.format(ord(c)) for c in secret).encode())
    forms |= {PERCENT.sub(lambda m: m[0].lower(), form) for form in forms}  # %2F or %2f
    return tuple(sorted(forms, key=len, reverse=True))


@dataclass(frozen=True, slots=True)
class Price:
    input: float = 0.0  # currency units per million prompt tokens
    output: float = 0.0  # per million completion tokens


@dataclass(frozen=True)
class ProviderSettings:
    name: str
    base_url: str  # including the /v1
    api_key_env: str  # the environment variable that holds its API key
    models: dict[str, str] = field(default_factory=dict)  # our public model -> the provider's model
    price: Price = Price()
    timeout: float = 120.0
    send_trace_context: bool = False  # the trace context headers go to it only when the policy says so


class RentedProviders:
    """`overflow` maps each public model that may spill to the name of its provider."""

    def __init__(self, providers: list[ProviderSettings], overflow: dict[str, str]) -> None:
        self.prices: dict[str, Price] = {p.name: p.price for p in providers}
        self.timeouts = {p.name: p.timeout for p in providers}
        self.keys: dict[str, str] = {}
        self.trace_context = {p.name for p in providers if p.send_trace_context}  # providers told of traces
        for provider in providers:
            key = os.environ.get(provider.api_key_env, "")
            if key:
                self.keys[provider.name] = key
            else:
                log.error("rented provider %s is disabled: environment variable %s is not set",
                          provider.name, provider.api_key_env)
        # every provider key as it may be quoted: an answer shows none of them (a key is long; never empty here)
        self.secret_forms = tuple(sorted({form for key in self.keys.values() for form in quoted_forms(key)},
                                         key=len, reverse=True))
        self.targets: dict[str, Replica] = {}  # public model -> its overflow target
        by_name = {p.name: p for p in providers}
        for model, provider_name in overflow.items():
            provider = by_name[provider_name]
            if provider.name in self.keys:
                self.targets[model] = Replica(
                    name=f"rented:{provider.name}", model=model, url=provider.base_url,
                    served_name=provider.models[model], rented=provider.name, state=UP,
                )

    def connect(self, client: Client) -> None:
        """Each target's upstream through `client`, carrying its provider's key (made once per client)."""
        for target in self.targets.values():
            if target.upstream is None or target.upstream.client is not client:
                provider = target.rented
                assert provider is not None  # every target here is a rented one (made above)
                target.upstream = Upstream(client, target.url, timeout=self.timeouts[provider],
                                           headers={"authorization": f"Bearer {self.keys[provider]}"})

    def cost(self, provider: str, prompt_tokens: int, completion_tokens: int) -> float:
        price = self.prices[provider]
        return (prompt_tokens * price.input + completion_tokens * price.output) / 1_000_000

    def scrub(self, data: bytes) -> bytes:
        """`data` from a rented provider with every provider key in it replaced by REDACTED. Whole: a key cut
        between two pieces is not found, so streams are scrubbed an event at a time."""
        for form in self.secret_forms:
            if form in data:
                data = data.replace(form, REDACTED)
        return data

    def scrub_text(self, text: str) -> str:
        """`scrub` for a header value (latin-1, as HTTP heads are read)."""
        scrubbed = self.scrub(text.encode("latin-1"))
        return scrubbed.decode("latin-1")
