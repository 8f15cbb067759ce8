"""Priority classes across two gateway processes on one real Redis sharing one backend's cap: a batch class with
a min_share gets its share of the slots while interactive traffic on both replicas alone fills the cap; without
one it starves, as documented, and its 429 says its own max_wait."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.cluster import cluster

CAP = 2
BODY = {"model": "m", "prompt": "x", "max_tokens": 4, "ignore_eos": True}


def classes(min_share: float, batch_max_wait: float) -> dict:
    return {"classes": [{"name": "interactive"},
                        {"name": "batch", "max_wait": batch_max_wait, "min_share": min_share}]}


async def mixed_load(urls: list[str], chat_key: str, batch_key: str, answers: int,
                     until_refused: bool = False) -> tuple[int, int, list[httpx.Response]]:
    """Three interactive clients per replica send back to back (six against a cap of 2: requests always wait on
    both); once they all have answers, two batch clients per replica send beside them, until the interactive
    clients have had `answers` more (bounded), or the first batch 429 with `until_refused`. Returns the
    answers each class got meanwhile and the batch refusals."""
    counts = {"interactive": 0, "batch": 0}
    refusals: list[httpx.Response] = []
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as http:

        def going() -> bool:
            return counts["interactive"] < answers and not (until_refused and refusals)

        async def send(url: str, key: str) -> httpx.Response:
            return await http.post(f"{url}/v1/completions", json=BODY, headers={"authorization": f"Bearer {key}"})

        async def interactive(url: str) -> None:
            warm = 0
            while warm < 3:  # every client's first answers come before the count starts
                r = await send(url, chat_key)
                assert r.status_code == 200, r.text
                warm += 1
            started.set()
            while going():
                r = await send(url, chat_key)
                assert r.status_code == 200, r.text
                counts["interactive"] += 1

        async def batch(url: str) -> None:
            await asyncio.wait_for(started.wait(), 60)
            while going():
                r = await send(url, batch_key)
                if r.status_code == 200:
                    counts["batch"] += 1
                else:
                    refusals.append(r)

        await asyncio.gather(*(interactive(u) for u in urls for _ in range(3)), *(batch(u) for u in urls for _ in range(2)))
    return counts["interactive"], counts["batch"], refusals


@pytest.mark.parametrize("min_share", [0.2])
def test_batch_gets_its_min_share_across_replicas_under_steady_interactive_load(tmp_path, min_share):
    with cluster(tmp_path, replicas=2, slow=True, backend={"cap": CAP}, model={"queue": {"max_wait": 60}},
                 priorities=classes(min_share, batch_max_wait=300)) as c:
        chat_key, batch_key = c.issue_key(), c.issue_key(priority_class="batch")
        interactive, batch, refusals = asyncio.run(mixed_load(c.urls, chat_key, batch_key, answers=100))
    assert not refusals, [r.text for r in refusals]
    # four batch requests always wait (two per replica), so every slot freed adds 0.2 to batch's credit and
    # every fifth goes to batch, whichever replica freed it: 20% of the answers; tolerance: 0.7x to 1.6x
    share = batch / (interactive + batch)
    assert 0.7 * min_share <= share <= 1.6 * min_share, (interactive, batch)


def test_without_min_share_batch_starves_across_replicas_and_its_429_says_its_max_wait(tmp_path):
    with cluster(tmp_path, replicas=2, slow=True, backend={"cap": CAP}, model={"queue": {"max_wait": 60}},
                 priorities=classes(0.0, batch_max_wait=1.5)) as c:
        chat_key, batch_key = c.issue_key(), c.issue_key(priority_class="batch")
        # bounded: 2000 interactive answers take far longer than batch's 1.5 s even on a fast machine
        interactive, batch, refusals = asyncio.run(mixed_load(c.urls, chat_key, batch_key, answers=2000,
                                                              until_refused=True))
    assert batch == 0 and refusals, (interactive, batch)
    assert refusals[0].status_code == 429 and refusals[0].headers["retry-after"] == "2"
    assert refusals[0].json()["error"]["code"] == "model_at_capacity"
