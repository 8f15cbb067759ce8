"""Rendering console pages: the navigation, asset URLs that change with their content, and HTML errors.

Pages are Jinja templates (autoescaped) rendered by Litestar's template engine; htmx asks for fragments of them
(the `HX-Request` header), so a page and its live parts come from the same template files.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from litestar import MediaType, Response
from litestar.exceptions import HTTPException
from litestar.response import Redirect, Template
from pydantic import ValidationError

from gateway.http.asgi import AnyRequest
from gateway.console.session import PREFIX, ConsoleOff, SignInNeeded
from policies.errors import GatewayError
from policies.store import StoreUnavailable

log = logging.getLogger("gateway.console")

STATIC = Path(__file__).parent / "static"
TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True, slots=True)
class NavItem:
    path: str
    title: str
    team: bool = False  # shown to a team admin


NAV: list[NavItem] = []  # filled by gateway/console/__init__.py from its PAGES


@cache
def asset(name: str) -> str:
    """A static file's URL with its content's hash: a changed file is a new URL, so no cache serves an old one.
    Vendored libraries carry their version in their names too (static/VENDORED.md)."""
    digest = hashlib.sha256((STATIC / name).read_bytes()).hexdigest()[:12]
    return f"{PREFIX}/static/{name}?v={digest}"


def is_fragment(request: AnyRequest) -> bool:
    """htmx asked for a part of a page (boosted links and history restores get whole pages)."""
    h = request.headers
    return (h.get("hx-request") == "true" and h.get("hx-boosted") != "true"
            and h.get("hx-history-restore-request") != "true")


def page(request: AnyRequest, template: str, title: str, status: int = 200, **context: Any) -> Template:
    return Template(template_name=template, status_code=status, headers={"cache-control": "no-store"},
                    context={"title": title, "viewer": getattr(request.state, "viewer", None), "nav": NAV,
                             "asset": asset, "here": request.url.path, "fragment": is_fragment(request),
                             **context})


def html_error(request: AnyRequest, status: int, message: str) -> Response[str]:
    """A failure as HTML: a fragment for htmx (it swaps it into the form's result area), else a whole page."""
    engine = request.app.template_engine
    assert engine is not None  # the app is built with the console's template_config (gateway/app.py)
    body = engine.get_template("error.html").render(
        title="Error", message=message, status=status, viewer=getattr(request.state, "viewer", None), nav=NAV,
        asset=asset, here=request.url.path, fragment=is_fragment(request))
    return Response(body, status_code=status, media_type=MediaType.HTML, headers={"cache-control": "no-store"})


def on_error(request: AnyRequest, exc: Exception) -> Response[Any]:
    """The console router's exception handler: HTML instead of the API's JSON errors."""
    if isinstance(exc, ConsoleOff):
        return Response(exc.body(), status_code=exc.status, media_type=MediaType.JSON)
    if isinstance(exc, StoreUnavailable):
        return html_error(request, 503, "the key store is unavailable; try again shortly")
    if isinstance(exc, SignInNeeded):
        if request.method == "GET" and not is_fragment(request):
            return Redirect(f"{PREFIX}/signin", status_code=303)
        response = html_error(request, 401, "Your session has ended: sign in again.")
        response.headers["hx-redirect"] = f"{PREFIX}/signin"
        return response
    if isinstance(exc, GatewayError):
        return html_error(request, exc.status, str(exc))
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        return html_error(request, 400, f"{where}: {first['msg']}" if where else first["msg"])
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return html_error(request, exc.status_code, str(exc.detail))
    log.exception("console page failed", exc_info=exc)
    return html_error(request, 500, "the console failed to handle this request")
