"""GET /v1/models and GET /v1/models/{model}, answered by the gateway itself: the public models this key may
use (vLLM has no /v1/models/{id}, and its names are the served ones, not the public ones)."""

from __future__ import annotations

from gateway.endpoints.base import NONE, Asked, Route
from gateway.needs import Models
from policies.errors import NotFound
from policies.keys import KeyRecord


async def listing(gateway: Models, key: KeyRecord, _asked: Asked) -> bytes:
    return gateway.models_listing(key)


async def one(gateway: Models, key: KeyRecord, asked: Asked) -> bytes:
    params = asked.params
    found = gateway.model_entry(key, params["model"])
    if found is None:
        raise NotFound(f"The model '{params['model'][:200]}' does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    return found


LIST = Route("models", "/v1/models", methods=("GET",), body=NONE, answer=listing,
             limited=False)  # what a client may ask: never refused for asking too often
RETRIEVE = Route("models/retrieve", "/v1/models/{model:path}", methods=("GET",), body=NONE, answer=one,
                 limited=False)
