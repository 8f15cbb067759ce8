"""Egress at connect time: every connection to an owned backend goes to an address checked to be private.

DNS can change after the policy was loaded, so `GuardedDialer` makes every connection of the shared HTTP
client (backends/http1.py): it resolves the name itself, checks every address against the private networks it
was given, and connects to a checked address, so the check and the connection use the same answer. A refusal
is a connect error: the proxy marks the replica down and may retry another one. Connections already open stay
with the private address they went to. Origins declared exempt (rented providers) connect as usual.

The address helpers here (`networks`, `inside`, `lookup`) are also what the load-time check
(policies/egress.py) and the ingress rules use.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import anyio

from backends.http1 import (
    ConnectFailed,
    ConnectTimedOut,
    Connection,
    Dialer,
    SocketDialer,
    parse_origin,
)

log = logging.getLogger("gateway.egress")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """Every address `host` resolves to; raises OSError when it cannot be resolved."""


class SystemResolver:
    """The operating system's resolver, without blocking the event loop."""

    async def resolve(self, host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


def networks(cidrs: Iterable[str]) -> list[Network]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


def parse_address(text: str) -> Address | None:
    """An IP address, IPv4-mapped IPv6 unwrapped (::ffff:10.0.0.1 is 10.0.0.1); None when not an IP literal."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def inside(address: str, nets: list[Network]) -> bool:
    parsed = parse_address(address)
    return parsed is not None and any(parsed in net for net in nets)


def private_for_provider(address: str, nets: list[Network]) -> bool:
    """An address a rented provider must not have: one of ours, or anything not routable on the Internet."""
    parsed = parse_address(address)
    return parsed is None or not parsed.is_global or any(parsed in net for net in nets)


def origin(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL as the connection pool will see it: IDNA-encoded, default port filled in."""
    parsed = parse_origin(url)
    return parsed.host, parsed.port


async def lookup(resolver: Resolver, host: str, port: int, timeout: float) -> list[str]:
    """An IP literal as is, a name through the resolver; OSError (or TimeoutError) when it does not resolve."""
    if parse_address(host) is not None:
        return [host]
    with anyio.fail_after(timeout):
        addresses = await resolver.resolve(host, port)
    if not addresses:
        raise OSError(f"no address for {host}")
    return addresses


class EgressRefused(ConnectFailed):
    """A connection the egress rules forbid; a connect error, so the replica is marked down and retried."""


class GuardedDialer:
    """Resolves and checks every owned host before connecting, then connects to the checked address.

    TLS still verifies the hostname (it is the server name of the handshake and stays in the Host header);
    only the TCP connection goes to the address. Origins in `exempt` (rented providers) connect as usual.
    """

    def __init__(
        self,
        private_cidrs: Iterable[str],
        resolver: Resolver,
        exempt: Iterable[tuple[str, int]] = (),
        on_refused: Callable[[str, int, str], None] | None = None,
        inner: Dialer | None = None,
    ) -> None:
        self.resolver = resolver
        self.set_rules(private_cidrs, exempt)
        self.on_refused = on_refused
        self.inner = inner or SocketDialer()

    def set_rules(self, private_cidrs: Iterable[str], exempt: Iterable[tuple[str, int]] = ()) -> None:
        """The networks owned hosts must resolve into and the exempt origins (replaced by a policy reload)."""
        self.nets = networks(private_cidrs)
        self.exempt = {(host.lower(), port) for host, port in exempt}

    async def dial(self, host: str, port: int, *, tls: bool, server_name: str, timeout: float | None,
                   factory: Callable[[], Connection]) -> Connection:
        if (host.lower(), port) in self.exempt:
            return await self.inner.dial(host, port, tls=tls, server_name=server_name, timeout=timeout,
                                         factory=factory)
        deadline = None if timeout is None else time.monotonic() + timeout
        addresses = await self.checked(host, port, timeout)
        error: Exception | None = None
        for address in addresses:  # every one was checked; the first that answers wins
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await self.inner.dial(address, port, tls=tls, server_name=server_name, timeout=left,
                                             factory=factory)
            except ConnectFailed as exc:
                error = exc
        assert error is not None  # lookup never returns an empty list
        raise error

    async def checked(self, host: str, port: int, timeout: float | None) -> list[str]:
        try:
            addresses = await lookup(self.resolver, host, port, timeout if timeout is not None else 30.0)
        except TimeoutError:
            raise ConnectTimedOut(f"resolving {host} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot resolve {host}: {exc}") from None
        for address in addresses:
            if not inside(address, self.nets):
                log.warning("refused: backend %s:%d resolved to public address %s (outside network.private_cidrs);"
                            " not connecting", host, port, address)
                if self.on_refused is not None:
                    self.on_refused(host, port, address)
                raise EgressRefused(f"egress refused: {host} resolved to public address {address}")
        return addresses
