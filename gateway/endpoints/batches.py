"""The Batch API: POST /v1/batches, GET /v1/batches (cursor paging: `after`, `limit`), GET /v1/batches/{id} and
POST /v1/batches/{id}/cancel, answered by the gateway from the Batch API's state (policies/batches/); the lines
run in the background (policies/batches/runner.py). A batch is its key's alone, as its files are."""

from __future__ import annotations

import orjson

from gateway.endpoints.base import NONE, Asked, Route, parse_json
from gateway.endpoints.files import limit_of, query_of, service, stored
from gateway.needs import BatchGateway
from policies.keys import KeyRecord


async def create(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    body = parse_json(asked.body)
    record = await stored(service(gateway).create(key.id, asked.client_host, body))
    gateway.batch_runner_wake()
    return orjson.dumps(record)


async def listing(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    query = query_of(asked.query, ("limit", "after"))
    return orjson.dumps(await stored(service(gateway).list_batches(key.id, query.get("after"),
                                                                   limit_of(query, 20, 100))))


async def retrieve(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    return orjson.dumps(await stored(service(gateway).batch(key.id, asked.params["id"])))


async def cancel(gateway: BatchGateway, key: KeyRecord, asked: Asked) -> bytes:
    return orjson.dumps(await stored(service(gateway).cancel(key.id, asked.params["id"])))


CREATE = Route("batches", "/v1/batches", answer=create)
LIST = Route("batches/list", "/v1/batches", methods=("GET",), body=NONE, answer=listing)
RETRIEVE = Route("batches/retrieve", "/v1/batches/{id}", methods=("GET",), body=NONE, answer=retrieve)
CANCEL = Route("batches/cancel", "/v1/batches/{id}/cancel", body=NONE, answer=cancel)
