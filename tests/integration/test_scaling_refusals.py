"""GET /scaling's refusals: it takes no token (an autoscaler reads it as Prometheus reads /metrics; the chart's
NetworkPolicy decides who reaches it), so a token sent or not changes nothing and is never echoed, while a bad
query is a 4xx in the gateway's error shape that does not echo what it was given at length."""

from __future__ import annotations

import httpx

from tests.support.gateway import TEST_KEY, running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

FORGED = "Bearer eyJhbGciOiJIUzI1NiJ9.eyJyb2xlIjoiYWRtaW4ifQ.forged-signature-0123456789"


async def test_scaling_refuses_a_bad_query_clearly_and_never_echoes_a_token():
    async with serve_app(Recorder()) as up, running_gateway(
            {"models": [{"name": "m", "backends": [{"url": up, "cap": 4}]}]}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        plain = await http.get("/scaling", params={"model": "m"})
        assert plain.status_code == 200 and plain.json()["needed"] == 0, plain.text
        for authorization in (FORGED, f"Bearer {TEST_KEY}", "Basic dXNlcjpodW50ZXIy"):
            r = await http.get("/scaling", params={"model": "m"}, headers={"authorization": authorization})
            assert r.status_code == 200 and r.json() == plain.json()  # no token needed, none judged
            assert authorization.split()[1] not in r.text and authorization.split()[1] not in str(r.headers)

        r = await http.get("/scaling", params={"model": "nosuch"}, headers={"authorization": FORGED})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
        assert "forged-signature" not in r.text

        long_secret = "sk-" + "x" * 200  # a secret pasted into the wrong place: at most its first 128 characters
        r = await http.get("/scaling", params={"model": long_secret})
        assert r.status_code == 404 and long_secret not in r.text and len(r.text) < 600, r.text

        r = await http.get("/scaling", params={"model": "m" * 385})  # over the parameter's bound
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "Validation failed for GET /scaling: model: Expected `str` of length" \
            " <= 384" and "m" * 385 not in r.text  # Litestar's own text quoted the whole URL

        for method in ("POST", "PUT", "DELETE"):
            r = await http.request(method, "/scaling", headers={"authorization": FORGED})
            assert r.status_code == 405 and "forged-signature" not in r.text, (method, r.text)
