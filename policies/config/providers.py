"""Rented providers (the only public egress) and when an owned model may overflow to one."""

from __future__ import annotations

from pydantic import Field, field_validator

from policies.config.base import NAME, Seconds, Strict, http_url


class Price(Strict):
    input: float = Field(0.0, ge=0)  # currency units per million prompt tokens
    output: float = Field(0.0, ge=0)  # per million completion tokens


class Provider(Strict):
    """A rented OpenAI-compatible API: the only public egress, declared here and nowhere else."""

    name: str = Field(pattern=NAME)
    base_url: str  # e.g. https://api.openai.com/v1 (including the /v1)
    api_key_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")  # the key is read from this env var
    models: dict[str, str] = Field(min_length=1)  # our public model name -> the provider's model
    price_per_million_tokens: Price = Price()
    timeout: Seconds = 120.0
    allow_private_address: bool = False  # only for test stand-ins on loopback: say so explicitly
    # pass the trace context (`traceparent`, `tracestate`) to this provider: off, since a public API has no
    # business with a private client's trace ids or vendor state
    send_trace_context: bool = False

    @field_validator("base_url")
    @classmethod
    def valid_url(cls, url: str) -> str:
        return http_url(url)


class Overflow(Strict):
    """When an owned model may spill to a rented provider (only for keys whose data policy allows it)."""

    provider: str
    when_wait_exceeds: Seconds = 2.0  # every owned replica at its cap and the expected wait is longer
    when_unavailable: bool = True  # no owned replica is healthy
