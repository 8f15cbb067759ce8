"""Batches: every key's batches of the Batch API (policies/batches/), newest first, with their status, progress
(completed, failed, total), when they were made and their error file; an admin may cancel one that is still
running, as the key that made it may (POST /v1/batches/{id}/cancel), and the act lands in the audit log.

The batch store lists batches per key (each key's batches are its own: the design's tenancy), so the page asks
it once per key of the key store, or for one key only when the search names it. Live counts are read only for
the open batches on the page shown.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from litestar import get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import Parameter
from litestar.response import Redirect, Template

from gateway.admin.audit import Audited
from gateway.http.asgi import AnyRequest
from gateway.console.pages import Page
from gateway.console.render import is_fragment
from gateway.console.render import page as render
from gateway.console.session import form_of
from gateway.needs import Configured, Stored
from policies.batches.service import Batches
from policies.batches.store import OPEN
from policies.errors import Conflict, NotFound

KEY_ID = r"^[0-9a-f]{16}$"
BATCH_ID = Parameter(pattern=r"^batch_[0-9a-f]{1,64}$")
CANCELLABLE = ("validating", "in_progress")  # as the Batch API's cancel: later states end on their own
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired", "cancelled")


class BatchConsole(Configured, Stored, Audited, Protocol):
    """The batches page: the Batch API (None while the policy leaves it off), the keys whose batches it lists,
    the audit log of a cancel, and the console's page size."""

    batches: Batches | None


def handlers(gateway: BatchConsole) -> list[HTTPRouteHandler]:
    def service() -> Batches:
        if gateway.batches is None:
            raise Conflict("the Batch API is off in this gateway's policy (batch.enabled)", code="batches_off")
        return gateway.batches

    async def row(record: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
        """A batch as one row of the table: its live counts when it is still open."""
        owner = record["_owner"]
        shown = await service().counted(dict(record)) if record["status"] in OPEN else record
        return {"id": shown["id"], "key": owner, "key_name": names.get(owner, ""), "status": shown["status"],
                "counts": shown["request_counts"], "created": iso(shown["created_at"]),
                "error_file": shown.get("error_file_id"), "output_file": shown.get("output_file_id"),
                "endpoint": shown.get("endpoint"), "cancellable": shown["status"] in CANCELLABLE}

    async def listed(key: str, status: str, page: int) -> dict[str, Any]:
        """The page's context: batches of the keys the search names (all: none named), of one status or any."""
        batches = service()
        records = {r.id: r for r in await gateway.store.list_keys()}
        names = {key_id: r.name for key_id, r in records.items()}
        wanted = key.strip().casefold()
        owners = [k for k, r in records.items()
                  if not wanted or wanted == k or wanted in r.name.casefold() or wanted in (r.owner or "").casefold()]
        found: list[dict[str, Any]] = []
        for owner in owners:
            found.extend(await batches.store.list_batches(owner))
        if status:
            found = [r for r in found if r["status"] == status]
        found.sort(key=lambda r: (r.get("_created", r["created_at"]), r["id"]), reverse=True)
        size = gateway.policy.console.page_size
        pages = max(1, math.ceil(len(found) / size))
        page_no = min(page, pages)
        rows = [await row(r, names) for r in found[(page_no - 1) * size: page_no * size]]
        return {"rows": rows, "key": key, "state": status, "statuses": STATUSES, "page_no": page_no,
                "pages": pages, "total": len(found), "message": None}

    @get("/batches")
    async def listing(request: AnyRequest, key: str = Parameter(default="", max_length=200),
                      status: str = Parameter(default="", max_length=40),
                      page: int = Parameter(default=1, ge=1, le=10**6)) -> Template:
        template = "batches_table.html" if request.headers.get("hx-target") == "batches-table" else "batches.html"
        return render(request, template, "Batches", **await listed(key, status, page))

    @post("/batches/{key_id:str}/{batch_id:str}/cancel", opt={"role": "admin"}, status_code=200)
    async def cancel(request: AnyRequest, key_id: str = Parameter(pattern=KEY_ID),
                     batch_id: str = BATCH_ID) -> Template | Redirect:
        batches = service()
        before = await batches.store.get_batch(key_id, batch_id)
        if before is None:
            raise NotFound(f"no batch {batch_id} of key {key_id}", code="batch_not_found")
        after = await batches.cancel(key_id, batch_id)
        if after["status"] != before["status"]:
            await gateway.audit.act(request, "batch.cancel", batch_id,
                                    {"key_id": key_id, "status": {"from": before["status"], "to": after["status"]}})
        if not is_fragment(request):  # a plain form post (no htmx): back to the list
            return Redirect("/console/batches", status_code=303)
        fields = await form_of(request)  # the list as it was shown: its search, status and page
        page_no = int(fields["page"]) if fields.get("page", "").isdigit() else 1
        context = await listed(fields.get("key", "")[:200], fields.get("status", "")[:40], max(1, page_no))
        context["message"] = f"{batch_id}: {after['status']}; lines not yet started will not run."
        return render(request, "batches_table.html", "Batches", **context)

    return [listing, cancel]


def iso(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at)) if at else "–"


PAGE = Page("batches", "Batches", handlers)
