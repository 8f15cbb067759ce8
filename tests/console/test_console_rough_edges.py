"""Rough edges of the console, over HTTP: the own-or-rent reason is whole sentences in plain words (as the CLI
and the JSON give it), a LoRA adapter's card is priced as its base model, and the fleet page names replica sets
and refused calls in words rather than in internal labels."""

from __future__ import annotations

import re

import httpx
import pytest

from tools.simulator import SimConfig
from tools.simulator import create_app as simulator
from gateway.admin.auth import mint_token
from policies.config import Admin
from policies.ledger.report import recommend
from tests.support.gateway import TEST_KEY, running_gateway
from tests.support.servers import serve_app

SECRET = "r" * 40
CONSOLE = {"enabled": True, "secure_cookie": False}


@pytest.fixture(autouse=True)
def admin_secret(monkeypatch):
    monkeypatch.setenv(Admin().jwt_secret_env, SECRET)


async def signed_in(http: httpx.AsyncClient) -> None:
    form = await http.get("/console/signin")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    token = mint_token(Admin(), 900, role="viewer", secret=SECRET)
    assert (await http.post("/console/signin", data={"csrf": nonce, "token": token})).status_code == 303


def text_of(html: str) -> str:
    """What a reader sees: the page's text, tags (and their attributes) stripped."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_an_owning_never_pays_off_reason_ends_in_a_whole_sentence_in_plain_words():
    figures = {"owned_cost": 10.0, "actual_cost": 10.0, "rent_all_cost": 1.0, "own_all_cost": 12.0,
               "utilisation": 0.2, "burstiness": 1.0, "batch_fill": 0.18, "break_even_utilisation": 2.5,
               "rented": {"cost": 0.0, "requests": 0}}
    reason = recommend(figures, tokens=1000)["reason"]
    assert "batches 18%" not in reason and "on average 18% of the cap in flight" in reason
    assert not reason.rstrip(" .").endswith("would"), reason  # not cut off mid-sentence
    assert reason.endswith("or with cheaper GPUs") and "250% utilisation" in reason


async def test_a_lora_adapters_card_is_priced_as_its_base_model():
    model = {"name": "m", "served_name": "served-m",
             "backends": [{"url": "http://127.0.0.1:9", "cost": {"per_hour": 2}}],
             "lora": {"adapters": [{"name": "m-support"}]}}
    policy = {"models": [model], "console": CONSOLE}
    async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        await signed_in(http)
        r = await http.get("/console/report")
        assert r.status_code == 200
        card = re.search(r'<section class="card adapter"[^>]*data-adapter="m-support".*?</section>', r.text, re.S)
        assert card is not None, r.text
        shown = text_of(card.group(0))
        assert "cost.per_hour" not in shown and "declares" not in shown
        assert "priced as m" in shown and "m's owned cost" in shown
        verdict = (await http.get("/console/report.json")).json()["models"]["m"]["recommendation"]["verdict"]
        assert f"m-support: {verdict}, as m" in shown
        assert 'data-model="m-support"' not in r.text  # no chart of its own: its base's charts stand for it
        assert 'data-chart="cost" data-model="m"' in r.text


async def test_the_fleet_page_names_variants_and_refused_calls_in_words():
    served = SimConfig(model="served")
    async with serve_app(simulator(served)) as a, serve_app(simulator(served)) as b:
        policy = {"console": CONSOLE, "health": {"interval": 0.2, "backoff_initial": 0.2, "backoff_max": 1},
                  "models": [{"name": "support", "served_name": "served", "variants": [
                      {"name": "base", "weight": 50, "backends": [{"url": a}]},
                      {"name": "tuned", "weight": 50, "backends": [{"url": b}]}]}]}
        async with running_gateway(policy) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            r = await http.post("/v1/chat/completions", content=b"{not json",
                                headers={"authorization": f"Bearer {TEST_KEY}", "content-type": "application/json"})
            assert r.status_code == 400  # a call refused before any model or backend
            r = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {TEST_KEY}"},
                                json={"model": "support", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            await signed_in(http)
            page = await http.get("/console/fleet")
            shown = text_of(page.text)
            assert "#" not in shown, [w for w in shown.split() if "#" in w]
            assert "support, variant base:" in shown and "support, variant tuned:" in shown
            answered = text_of(page.text.split('class="answered"', 1)[1])
            assert " unknown " not in answered and " none " not in answered
            assert "no model (refused before one was read) not sent to a backend 400" in answered
