"""The Responses API: POST /v1/responses (streamed as `event:` + `data:` frames, usage in `response.completed`),
GET /v1/responses/{id} and POST /v1/responses/{id}/cancel.

vLLM keeps a stored response in the memory of the one server that made it, so a response id must lead back
to that replica, from any gateway replica, with no shared state: the gateway names each response itself
(vLLM takes the id from the body's `request_id`) as `resp_<tag><owner><random>`, where the tag is a hash of the
replica's stable name and `owner` binds the id to the key that made it (policies/ownership.py). A retrieve, a
cancel, or a new response continuing it (`previous_response_id`) goes to the replica whose tag the id carries;
an id the gateway did not make, whose replica is gone, or that another key made, is the same 404.
A retrieve forwards its query (`stream`, `starting_after`, `include`): with `stream=true` vLLM streams the stored
events of a response made with `background` and `stream`, relayed with no tokens counted (they were, when it
was made).
Responses served by a rented provider keep the provider's ids and cannot be retrieved through the gateway.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterable
from functools import lru_cache

from backends.replicas import Replica
from gateway.endpoints.base import (NONE, Route, forward_query, io_usage, no_usage, query_count, query_flag,
                                    query_text)
from gateway.relay import EventRelay, ReplayRelay
from policies.errors import NotFound
from policies.json_types import JSON, JSONObject
from policies.ownership import TAG as OWNER_TAG
from policies.ownership import TAG_OWNER, claims_of
from policies.pipeline import Call
from policies.routing.prompt import responses_text
from policies.tokens import RESPONSES

PREFIX = "resp_"
TAG = 8  # hex characters of the replica's tag
START = len(PREFIX) + TAG + OWNER_TAG  # where the id's random part begins


@lru_cache(maxsize=1024)
def tag(replica_name: str) -> str:
    return hashlib.blake2b(replica_name.encode(), digest_size=TAG // 2).hexdigest()


def new_id(replica: Replica, tag_owner: Callable[[str], str]) -> str:
    replica_tag, nonce = tag(replica.name), secrets.token_hex(12)
    return f"{PREFIX}{replica_tag}{tag_owner(replica_tag + nonce)}{nonce}"


def replica_of(response_id: JSON, replicas: Iterable[Replica]) -> Replica | None:
    if not isinstance(response_id, str) or not response_id.startswith(PREFIX) or len(response_id) <= START:
        return None
    wanted = response_id[len(PREFIX):len(PREFIX) + TAG]
    return next((r for r in replicas if r.rented is None and tag(r.name) == wanted), None)


def pinned(call: Call, response_id: JSON, replicas: Iterable[Replica], unknown: NotFound) -> Replica:
    """The replica that holds `response_id`; that the id is the caller's own is checked once it is known who
    calls (policies/ownership.py), with the same refusal as an id no replica has."""
    replica = replica_of(response_id, replicas)
    if replica is None or not isinstance(response_id, str):  # (replica_of finds none for an id that is not text)
        raise unknown
    replica_tag = response_id[len(PREFIX):len(PREFIX) + TAG]
    claims_of(call).ids.append((replica_tag + response_id[START:], response_id[len(PREFIX) + TAG:START], unknown))
    return replica


def pin_by_path(call: Call, replicas: Iterable[Replica]) -> Replica:
    response_id = call.request.params["id"]
    return pinned(call, response_id, replicas, NotFound(f"No response found with id '{response_id}'.",
                                                        param="response_id", code="response_not_found"))


def pin_previous(call: Call, replicas: Iterable[Replica]) -> Replica | None:
    claims_of(call).mints = True  # the new response's id is tagged with its key
    previous = call.body.get("previous_response_id")
    if previous is None:
        return None
    return pinned(call, previous, replicas, NotFound(f"Previous response with id '{str(previous)[:200]}' not found.",
                                                     param="previous_response_id",
                                                     code="previous_response_not_found"))


def pinned_model(call: Call) -> str | None:
    return call.pinned.model if call.pinned is not None else None


def assign_id(call: Call, body: JSONObject, replica: Replica) -> None:
    if replica.rented is None:
        # set by the owners step: pin_previous marks the call as minting ids
        body["request_id"] = new_id(replica, TAG_OWNER.of(call))
    else:
        body.pop("request_id", None)


def final_usage(frame: JSONObject) -> dict[str, int] | None:
    response = frame.get("response")
    return io_usage(response.get("usage")) if isinstance(response, dict) else None


# The last frame of a response's events. vLLM ends its stream of a background response (as it is made, and
# replayed) only after `response.completed`: one that failed (an `error` frame) it keeps open, silent, until
# the read timeout; the gateway ends it after that frame instead.
LAST = (b"response.completed", b"response.incomplete", b"response.failed", b"error")


def relay(call: Call, rename: tuple[bytes, bytes] | None) -> EventRelay:
    return EventRelay({b"response.completed": final_usage, b"response.incomplete": final_usage,
                       b"response.failed": final_usage}, rename, LAST if call.body.get("background") is True else ())


def replay(_call: Call, rename: tuple[bytes, bytes] | None) -> ReplayRelay:
    return ReplayRelay(rename, LAST)


RETRIEVE_QUERY = forward_query({"stream": query_flag, "starting_after": query_count, "include": query_text,
                                "include[]": query_text, "include_obfuscation": query_flag},
                               repeated=("include", "include[]"))


def usage(data: JSONObject) -> dict[str, int] | None:
    return io_usage(data.get("usage"))


CREATE = Route("responses", "/v1/responses", tokens=RESPONSES, usage=usage, relay=relay, pin=pin_previous,
               prepare=assign_id, rentable=True, prompt=responses_text)
RETRIEVE = Route("responses/retrieve", "/v1/responses/{id}", methods=("GET",), body=NONE, pin=pin_by_path,
                 model=pinned_model, usage=no_usage, query=RETRIEVE_QUERY, relay=replay, stream_by_answer=True)
CANCEL = Route("responses/cancel", "/v1/responses/{id}/cancel", body=NONE, pin=pin_by_path, model=pinned_model,
               usage=no_usage)
