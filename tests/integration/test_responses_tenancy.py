"""A stored response belongs to the key that made it, on every gateway replica: two `llm-gateway serve`
processes on one real redis-server over the vLLM simulator, two keys, the real openai SDK and raw HTTP.

Another key's retrieve, cancel, streamed replay or `previous_response_id` of an id answers exactly what an id
no one made answers (same status, body and headers), on the replica that made it and on the other one."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.cluster import cluster

VARYING = {"date", "x-request-id"}  # differ between any two answers


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("tenancy"), replicas=2) as c:
        yield c


def unknown_like(response_id: str) -> list[str]:
    """Ids of the same shape that no one made: on the same replica (its last character changed), and on none
    (its replica tag changed)."""
    return [response_id[:-1] + ("0" if response_id[-1] != "0" else "1"),
            response_id[:5] + ("0" if response_id[5] != "0" else "1") + response_id[6:]]


def answer(http: httpx.Client, method: str, path: str, **kw) -> tuple[int, str, dict[str, str]]:
    r = http.request(method, path, **kw)
    return r.status_code, r.text, {k: v for k, v in r.headers.items() if k not in VARYING}


def same_as_unknown(http: httpx.Client, method: str, path: str, theirs: str, **kw) -> tuple[int, str]:
    """What `http` gets for another key's id equals what it gets for an unknown id (the id aside)."""
    status, text, headers = answer(http, method, path.format(id=theirs), **kw)
    for unknown in unknown_like(theirs):
        kw_unknown = {k: (v | {"previous_response_id": unknown} if k == "json" else v) for k, v in kw.items()}
        expected = answer(http, method, path.format(id=unknown), **kw_unknown)
        assert (status, text.replace(theirs, unknown), headers) == expected
    return status, text


def test_another_keys_response_is_an_unknown_id_on_every_replica(pair):
    (one, two) = pair.urls
    key_a, key_b = pair.issue_key(name="a"), pair.issue_key(name="b")
    a_one = openai.OpenAI(base_url=f"{one}/v1", api_key=key_a, max_retries=0, timeout=30)
    made = a_one.responses.create(model="m", input="a secret conversation", max_output_tokens=4)
    events = list(a_one.responses.create(model="m", input="in the background", max_output_tokens=4,
                                         background=True, stream=True))
    replayable = events[-1].response.id

    for url in (one, two):  # the owner reaches both from either replica, and continues them
        a = openai.OpenAI(base_url=f"{url}/v1", api_key=key_a, max_retries=0, timeout=30)
        assert a.responses.retrieve(made.id).output_text == made.output_text
        assert a.responses.create(model="m", input="go on", previous_response_id=made.id,
                                  max_output_tokens=2).previous_response_id == made.id
        assert [e.type for e in a.responses.retrieve(replayable, stream=True)][-1] == "response.completed"

    for url in (one, two):
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key_b}"}, timeout=30) as b:
            status, text = same_as_unknown(b, "GET", "/v1/responses/{id}", made.id)
            assert status == 404 and "a secret conversation" not in text and "response_not_found" in text
            assert same_as_unknown(b, "GET", "/v1/responses/{id}?stream=true", replayable)[0] == 404
            assert same_as_unknown(b, "POST", "/v1/responses/{id}/cancel", replayable)[0] == 404
            status, text = same_as_unknown(b, "POST", "/v1/responses", made.id,
                                           json={"model": "m", "input": "x", "previous_response_id": made.id})
            assert status == 404 and "previous_response_not_found" in text
        b_sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=key_b, max_retries=0, timeout=30)
        with pytest.raises(openai.NotFoundError):
            b_sdk.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            b_sdk.responses.create(model="m", input="x", previous_response_id=made.id)
        # and B's own responses are B's: the check is per key, not a refusal of everything
        own = b_sdk.responses.create(model="m", input="mine", max_output_tokens=2)
        assert b_sdk.responses.retrieve(own.id).id == own.id
    # the admin token is no key for these routes: no back door
    admin = httpx.get(f"{one}/v1/responses/{made.id}", headers={"authorization": f"Bearer {pair.admin_token}"},
                      timeout=30)
    assert admin.status_code == 401


def test_the_owner_check_needs_no_store_round_trip(pair):
    """With the store stopped, the owner still retrieves its response on both replicas (its key from the auth
    cache, the id checked locally), and another key is still refused: the check reads nothing from the store."""
    (one, two) = pair.urls
    key_a, key_b = pair.issue_key(name="a2"), pair.issue_key(name="b2")
    made = openai.OpenAI(base_url=f"{one}/v1", api_key=key_a, max_retries=0, timeout=30).responses.create(
        model="m", input="kept", max_output_tokens=2)
    for url in (one, two):  # both replicas have verified both keys (and read the secret) before the outage
        for key in (key_a, key_b):
            httpx.get(f"{url}/v1/responses/{made.id}", headers={"authorization": f"Bearer {key}"}, timeout=30)
    pair.redis.pause()
    try:
        for url in (one, two):
            owner = httpx.get(f"{url}/v1/responses/{made.id}", headers={"authorization": f"Bearer {key_a}"},
                              timeout=30)
            assert owner.status_code == 200 and owner.json()["id"] == made.id
            other = httpx.get(f"{url}/v1/responses/{made.id}", headers={"authorization": f"Bearer {key_b}"},
                              timeout=30)
            assert other.status_code == 404
    finally:
        pair.redis.resume()
