"""The keys page: search and page through every key, issue one (its secret shown once), and on a key's own
page its usage, budget, settings (limits, budget, data policy, models, networks, expiry), rotation and revocation.
The list opens with a summary: how many keys are active, expired, revoked and in a team.

Everything goes through gateway/admin/keys.py, as the admin API does; a team admin sees and manages only its
team's keys (the list holds no other, and another team's key answers 403 as on the admin API). The key list is
read once per page (the store's one listing query) and filtered in memory: a few thousand records take tens of
milliseconds, and the page renders only `console.page_size` rows of them.
"""

from __future__ import annotations

import math
import time
from typing import Any

from litestar import get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from litestar.response import Template

from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import page as render
from gateway.console.session import form_of
from gateway.admin.keys import KeyAdmin, KeyChanges, KeyView, NewKey, Rotation
from gateway.admin.report import key_budget_status
from gateway.admin.teams import Accounts
from policies.errors import BadRequest
from policies.keys import KeyRecord

KEY_ID = Parameter(pattern=r"^[0-9a-f]{16}$")
NO_STORE = {"cache-control": "no-store"}
TEAM = {"team": True}  # a team admin may open it (its team's keys only)


def handlers(gateway: Accounts) -> list[HTTPRouteHandler]:
    keys = KeyAdmin(gateway)

    async def table(q: str, page: int, team: str | None) -> dict[str, Any]:
        """The keys table's context: the keys (of `team` when a team admin asks) matching `q`, one page of them."""
        records = [r for r in await gateway.store.list_keys() if team is None or r.team == team]
        found = search(records, q)
        size = gateway.policy.console.page_size
        pages = max(1, math.ceil(len(found) / size))
        page_no = min(page, pages)
        shown = [KeyView.of(r) for r in found[(page_no - 1) * size: page_no * size]]
        now = time.time()
        return {"keys": shown, "q": q, "page_no": page_no, "pages": pages, "total": len(found), "of": len(records),
                "now": now, "summary": summary_of(records, now)}

    @get("/keys", opt=TEAM)
    async def listing(request: AnyRequest, q: str = Parameter(default="", max_length=200),
                      page: int = Parameter(default=1, ge=1, le=10**6)) -> Template:
        template = "keys_table.html" if request.headers.get("hx-target") == "keys-table" else "keys.html"
        return render(request, template, "Keys", **await table(q, page, request.state.viewer.team))

    @post("/keys", opt={"role": "admin", **TEAM}, status_code=201)
    async def create(request: AnyRequest) -> Template:
        fields = await form_of(request)
        issued = await keys.create(request, NewKey.model_validate({**settings_of(fields), **expiry_of(fields)}))
        # the list, refreshed beside the secret (htmx swaps it in out of band), so the new key shows at once
        return render(request, "new_key.html", "New key", status=201, issued=issued, rotated=False,
                      listing=await table("", 1, request.state.viewer.team))

    @get("/keys/{key_id:str}", opt=TEAM)
    async def show(request: AnyRequest, key_id: str = KEY_ID) -> Template:
        view = KeyView.of(await keys.load(key_id, request))
        return render(request, "key.html", f"Key {view.name}", key=view, usage=await keys.usage(key_id, request),
                    budget=await key_budget_status(gateway, key_id), now=time.time(), message=None)

    @post("/keys/{key_id:str}", opt={"role": "admin", **TEAM}, status_code=200)
    async def update(request: AnyRequest, key_id: str = KEY_ID) -> Template:
        view = await keys.update(request, key_id, KeyChanges.model_validate(settings_of(await form_of(request))))
        return panel(request, view, "Saved.")

    @post("/keys/{key_id:str}/revoke", opt={"role": "admin", **TEAM}, status_code=200)
    async def revoke(request: AnyRequest, key_id: str = KEY_ID) -> Template:
        return panel(request, await keys.revoke(request, key_id), "Revoked: every replica refuses it within"
                     f" {gateway.policy.auth.cache_seconds:g} s.")

    @post("/keys/{key_id:str}/rotate", opt={"role": "admin", **TEAM}, status_code=200)
    async def rotate(request: AnyRequest, key_id: str = KEY_ID) -> Template:
        fields = await form_of(request)
        grace = fields.get("grace_seconds", "").strip()
        issued = await keys.rotate(request, key_id, Rotation.model_validate({"grace_seconds": grace} if grace else {}))
        return render(request, "new_key.html", "Rotated key", issued=issued, rotated=True)

    def panel(request: AnyRequest, view: KeyView, message: str) -> Template:
        return render(request, "key_panel.html", f"Key {view.name}", key=view, now=time.time(), message=message)

    return [listing, create, show, update, revoke, rotate]


def summary_of(records: list[KeyRecord], now: float) -> dict[str, Any]:
    """The keys page's headline figures: how many keys, active, expired, revoked, and in a team."""
    revoked = sum(1 for r in records if r.revoked)
    expired = sum(1 for r in records if not r.revoked and r.expires_at is not None and r.expires_at < now)
    return {"total": len(records), "active": len(records) - revoked - expired, "expired": expired,
            "revoked": revoked, "in_teams": sum(1 for r in records if r.team)}


def search(records: list[KeyRecord], q: str) -> list[KeyRecord]:
    """Keys whose id, name or owner holds `q` (any case), newest first."""
    q = q.strip().casefold()
    found = [r for r in records if not q or q in r.id or q in r.name.casefold() or q in (r.owner or "").casefold()]
    found.reverse()  # the store lists oldest first
    return found


def blank(value: str | None) -> str | None:
    value = (value or "").strip()
    return value or None


def listed(value: str | None) -> list[str] | None:
    """A comma- or space-separated list; empty: none (all models, any network)."""
    items = [v for v in (value or "").replace(",", " ").split() if v]
    return items or None


def limits_and_budget(fields: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The limits and budget fields of a key's or a team's settings form, as the admin API takes them: an empty
    field is null (no limit); no budget unless a spend or token bound is given."""
    limits = {k: blank(fields.get(k)) for k in ("requests_per_minute", "tokens_per_minute", "max_concurrent")}
    spend, tokens = blank(fields.get("max_rented_spend")), blank(fields.get("max_tokens_per_period"))
    budget = None
    if spend is not None or tokens is not None:
        budget = {"max_rented_spend": spend, "max_tokens_per_period": tokens,
                  "period": fields.get("period") or "month", "when_spent": fields.get("when_spent") or "owned_only"}
    return limits, budget


def settings_of(fields: dict[str, str]) -> dict[str, Any]:
    """A key's settings form as the admin API's body: an empty field is the default (null)."""
    limits, budget = limits_and_budget(fields)
    return {"name": fields.get("name", "").strip(), "owner": blank(fields.get("owner")),
            "models": listed(fields.get("models")), "data_policy": fields.get("data_policy") or None,
            "allowed_cidrs": listed(fields.get("allowed_cidrs")), "limits": limits, "budget": budget}


def expiry_of(fields: dict[str, str]) -> dict[str, Any]:
    days = blank(fields.get("expires_in_days"))
    if days is None:
        return {}
    try:
        return {"expires_in": float(days) * 86400}
    except ValueError:
        raise BadRequest("expires in: a number of days", param="expires_in_days") from None


PAGE = Page("keys", "Keys", handlers, team=True)
