"""What a key creates through the gateway (a stored response) belongs to that key: another key's request for
it answers exactly as for an id that never existed.

An id the gateway mints carries an owner tag: HMAC-SHA256 over the creating key's id and the rest of the id,
under a secret every gateway replica shares. The secret lives in the store (Store.shared_secret: made by
the first replica that needs it, read once per process, at start), so checking an id is a local computation,
with no store round trip per request and nothing to configure; a key's rotation keeps its id, so its
responses stay its own. The id itself is the only handle the backend has, so a caller cannot move an id onto its own key,
and without the secret it cannot mint an id that passes: every id it did not get from its own creations is
refused here, with the same 404 as an unknown one. There is no admin override: admin tokens do not reach
these routes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from policies.errors import StateUnavailable
from policies.pipeline import Call, Slot
from policies.store import Store, StoreError, StoreUnavailable

TAG = 16  # hex characters of an owner tag (64 bits: a guess is right once in 2**64)
SECRET_NAME = "owner-tags"


@dataclass(slots=True)
class Claims:
    """What a call's route found in its request before the pipeline: ids it names that must be its key's, and
    whether it will mint ids its key owns."""

    ids: list[tuple[str, str, Exception]] = field(default_factory=list)  # (what the tag covers, the tag, the refusal)
    mints: bool = False  # the owners step gives it TAG_OWNER


CLAIMS: Slot[Claims] = Slot("ownership claims")  # its route fills it (gateway/endpoints/responses.py)
TAG_OWNER: Slot[Callable[[str], str]] = Slot("owner tag")  # (rest of an id) -> its owner tag, for this call's key


def claims_of(call: Call) -> Claims:
    """The call's claims, made empty on first use."""
    claims = CLAIMS.get(call)
    if claims is None:
        claims = Claims()
        CLAIMS.put(call, claims)
    return claims


def owner_tag(secret: bytes, key_id: str, rest: str) -> str:
    return hmac.new(secret, f"{key_id}:{rest}".encode(), hashlib.sha256).hexdigest()[:TAG]


class Owners:
    """Pipeline step, right after authentication: refuses a call naming an id its key did not create
    (its CLAIMS), and gives a call that will mint ids the function that tags them (TAG_OWNER)."""

    name = "owners"
    writes = (TAG_OWNER,)

    def __init__(self, store: Store) -> None:
        self.store = store
        self.secret: bytes | None = None

    async def warm(self) -> None:
        """Read the secret ahead of the first request that needs it (at start); if the store does not answer,
        that request reads it."""
        with contextlib.suppress(StoreError):
            await self.load()

    async def load(self) -> bytes:
        if self.secret is None:
            self.secret = await self.store.shared_secret(SECRET_NAME)
        return self.secret

    async def enter(self, call: Call) -> None:
        claims = CLAIMS.get(call)
        if claims is None or not (claims.ids or claims.mints):
            return
        try:
            secret = await self.load()
        except StoreUnavailable:
            raise StateUnavailable("the store is unavailable; try again shortly") from None
        assert call.key is not None  # the key step ran first
        tag = partial(owner_tag, secret, call.key.id)
        for rest, carried, refusal in claims.ids:
            if not hmac.compare_digest(tag(rest), carried):
                raise refusal
        TAG_OWNER.put(call, tag)

    async def leave(self, call: Call) -> None:
        pass
