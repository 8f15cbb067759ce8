"""What every part of the policy schema shares: the strict base model, names, durations, URLs, and the
one error a policy that cannot be used raises."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"
Seconds = Annotated[float, Field(gt=0, le=86400)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
HostPort = Annotated[str, Field(pattern=r"^[A-Za-z0-9.:\[\]_-]+:[0-9]{1,5}$")]


def http_url(url: str) -> str:
    """A base URL the gateway may call: http(s), a host, and nothing that belongs elsewhere (credentials)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host, e.g. http://10.0.0.5:8000")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("must not carry a query, fragment or credentials")
    return url.rstrip("/")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyError(Exception):
    """A policy file that cannot be used; the message names every bad field and why."""
