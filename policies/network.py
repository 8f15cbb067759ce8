"""Ingress: who the client really is, and whether this gateway accepts requests from there.

The client address is the TCP peer, unless the peer is one of `network.trusted_proxies`; then it is read from
X-Forwarded-For, walking from the right (the entry the nearest proxy appended) past every entry that is itself
a trusted proxy: the first one that is not is the client. Entries further left were written by the client or
by proxies we do not trust and are never read, so a client cannot spoof its way in. If an entry reached on that
walk is not a plain IP address, or the header is missing or empty, the peer is used. From a peer that is not a
trusted proxy the header is ignored entirely. When every entry is a trusted proxy, the left-most one is used
(unless there are more than MAX_HOPS of them: then the peer).

The address found replaces `call.client_host`, so the per-key `allowed_cidrs` (policies/auth.py) see it too;
`network.allowed_client_cidrs`, when set, applies to every request before the key is even looked at.
"""

from __future__ import annotations

from backends.egress import inside, networks, parse_address
from policies.config import Network
from policies.errors import PermissionDenied
from policies.memo import Memo
from policies.pipeline import Call

PEER_CACHE = 4096  # addresses remembered (normalized, admitted or not); cleared when full
MAX_HOPS = 32  # entries read from the right of X-Forwarded-For; a longer chain of our own proxies is a loop


def normalized(peer: str) -> str:
    """An IP address in canonical text (IPv4-mapped IPv6 unwrapped); anything else as it is."""
    parsed = parse_address(peer)
    return peer if parsed is None else str(parsed)


class ClientNetwork:
    name = "client-network"
    writes = ()  # only the call's own fields

    def __init__(self, network: Network) -> None:
        self.trusted = networks(network.trusted_proxies)
        allowed = network.allowed_client_cidrs
        self.allowed = None if allowed is None else networks(allowed)
        self.normalized = Memo(normalized, limit=PEER_CACHE)  # peer address as the server gives it
        self.allowed_here = Memo(lambda address: self.allowed is None or inside(address, self.allowed),
                                 limit=PEER_CACHE)  # asked only when there is a list (admit)

    async def enter(self, call: Call) -> None:
        call.client_host = self.client_address(call.client_host, call.request.headers.get("x-forwarded-for"))
        self.admit(call.client_host)

    async def leave(self, call: Call) -> None:
        pass

    def client_address(self, peer: str, forwarded_for: str | None) -> str:
        """The real client's address as text (IPv4-mapped IPv6 unwrapped); `peer` itself when not an IP."""
        peer = self.normalized(peer)
        if not forwarded_for or not inside(peer, self.trusted):
            return peer
        entries = [e.strip() for e in forwarded_for.split(",")]
        hop = None
        for entry in reversed(entries[-MAX_HOPS:]):
            hop = parse_address(entry)
            if hop is None:
                return peer  # malformed where a trusted proxy wrote it
            if not inside(str(hop), self.trusted):
                return str(hop)
        return str(hop) if hop is not None and len(entries) <= MAX_HOPS else peer

    def admit(self, address: str) -> None:
        if self.allowed is not None and not self.allowed_here(address):
            raise PermissionDenied("requests from this network are not accepted by this gateway",
                                   code="source_not_allowed")
