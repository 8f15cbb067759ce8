"""Egress: owned backends stay on private networks; rented providers are the only declared public egress.

The rules, checked when the policy is loaded and again on every new connection:

- an owned backend's host must resolve ONLY to addresses inside `network.private_cidrs` (an IP literal is
  checked as is; for a hostname every A/AAAA record counts, so one public record is enough to refuse it);
- so must the tracing collector's endpoint, when tracing is on (checked at load only: the exporter is the
  OpenTelemetry SDK's own HTTP client);
- a rented provider is exempt from that rule, but the reverse holds for it: an address inside
  `private_cidrs` or not globally routable (loopback, RFC 1918, link-local such as cloud metadata, ULA, ...)
  is refused unless the provider says `allow_private_address: true`, so a typo cannot quietly send "rented"
  traffic into the cluster.

The load-time check alone is not enough (DNS can change after load): backends/egress.py's `GuardedDialer`
checks every new connection again, against the same rules.
"""

from __future__ import annotations

import asyncio
import logging

from backends.egress import (
    Resolver,
    SystemResolver,
    inside,
    lookup,
    networks,
    origin,
    parse_address,
    private_for_provider,
)
from policies.config import Policy, PolicyError, backend_name

log = logging.getLogger("gateway.egress")


async def check_backends(
    policy: Policy, resolver: Resolver | None = None, *, unresolved_fatal: bool = True, source: str = "<policy>",
    resolve: bool = True,
) -> list[str]:
    """Raise PolicyError naming every owned backend that resolves outside `network.private_cidrs` and every
    provider on a private address without `allow_private_address`. A host that does not resolve is an error
    too, unless `unresolved_fatal` is False: then it is only logged (the connect-time guard still holds).
    With `resolve` False only IP literals are checked (an offline check); returns the hosts left unchecked."""
    resolver = resolver or SystemResolver()
    nets = networks(policy.network.private_cidrs)
    targets: list[tuple[str, str, tuple[str, int], bool | None]] = []  # (what, url, origin, allow_private)
    for i, model in enumerate(policy.models):
        for j, backend in enumerate(model.backends):
            what = f"models[{i}](name={model.name}).backends[{j}](name={backend_name(model, j)})"
            targets.append((what, backend.url, origin(backend.url), None))
    for i, provider in enumerate(policy.providers):
        targets.append((f"providers[{i}](name={provider.name})", provider.base_url, origin(provider.base_url),
                        provider.allow_private_address))
    if policy.tracing.enabled:  # traces hold prompts' metadata (and text, where enabled): they stay inside too
        targets.append(("tracing.endpoint", policy.tracing.endpoint, origin(policy.tracing.endpoint), None))

    skipped = [] if resolve else list(dict.fromkeys(
        host for _, _, (host, _), _ in targets if parse_address(host) is None))
    targets = [t for t in targets if t[2][0] not in skipped]
    origins = list(dict.fromkeys(where for _, _, where, _ in targets))
    answers = await asyncio.gather(
        *(lookup(resolver, host, port, policy.timeouts.connect) for host, port in origins), return_exceptions=True
    )
    resolved = dict(zip(origins, answers, strict=True))

    problems, unresolved = [], []
    for what, url, (host, port), allow_private in targets:
        answer = resolved[(host, port)]
        if isinstance(answer, BaseException):
            if not isinstance(answer, (OSError, TimeoutError)):
                raise answer
            reason = "timed out" if isinstance(answer, TimeoutError) else str(answer) or type(answer).__name__
            unresolved.append(f"  {what}: cannot resolve host {host!r} of {url}: {reason}")
            continue
        if allow_private is None:
            bad = [a for a in answer if not inside(a, nets)]
            if bad:
                problems.append(f"  {what}: {url} resolves to public address {', '.join(bad)}, outside"
                                " network.private_cidrs (owned backends must stay on private networks)")
        elif not allow_private:
            bad = [a for a in answer if private_for_provider(a, nets)]
            if bad:
                problems.append(f"  {what}: {url} resolves to private address {', '.join(bad)}; a rented provider"
                                " must be public (set allow_private_address: true if this is intended)")
    if not unresolved_fatal:
        for line in unresolved:
            log.warning("egress check: %s (owned backends are checked again on every connection)", line.strip())
        unresolved = []
    if problems or unresolved:
        raise PolicyError(f"{source}: egress check failed\n" + "\n".join(problems + unresolved))
    return skipped


def exempt_origins(policy: Policy) -> set[tuple[str, int]]:
    """The rented providers' (host, port): the declared public egress."""
    return {origin(p.base_url) for p in policy.providers}
