"""Usage per key and per model over a window, from the own-or-rent report's figures (gateway.report, as
GET /admin/report); a key's usage per model since it was issued is on its own page (keys_page)."""

from __future__ import annotations

from litestar import Request, get
from litestar.params import Parameter
from litestar.response import Template

from gateway.console.pages import Page
from gateway.console.render import page
from gateway.console.windows import WINDOWS, window_of

TOP = 100  # keys shown, by tokens


def handlers(gateway) -> list:
    @get("/usage")
    async def usage(request: Request, window: int | None = Parameter(default=None, ge=1, le=90 * 86400)) -> Template:
        window = window_of(window)
        report = await gateway.report(window)
        ranked = sorted(report["keys"].items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))[:TOP]
        names = {}
        for key_id, _ in ranked:
            record = await gateway.store.get_key(key_id)
            names[key_id] = record.name if record is not None else None
        return page(request, "usage.html", "Usage", window=window, windows=WINDOWS, keys=ranked, names=names,
                    models=report["models"], more=max(0, len(report["keys"]) - TOP))

    return [usage]


PAGE = Page("usage", "Usage", handlers)
