"""The endpoint registry: every route of the OpenAI surface (and vLLM's extras), one line each.

A new route is one module declaring its `Route` (gateway/endpoints/base.py says what a declaration holds)
and one line here; a route the gateway answers itself declares what it asks of the gateway as a Protocol in
gateway/needs.py, where it joins `Answering`.
"""

from __future__ import annotations

from gateway.endpoints import (audio, batches, chat, completions, embeddings, files, messages, models, pooling,
                               responses, tokenize)
from gateway.endpoints.base import Route

ROUTES: tuple[Route, ...] = (
    chat.ROUTE,
    completions.ROUTE,
    embeddings.ROUTE,
    models.LIST,
    models.RETRIEVE,
    responses.CREATE,
    responses.RETRIEVE,
    responses.CANCEL,
    tokenize.TOKENIZE,
    tokenize.DETOKENIZE,
    pooling.RERANK,
    pooling.RERANK_V1,
    pooling.RERANK_V2,
    pooling.SCORE,
    pooling.SCORE_V1,
    pooling.POOLING,
    pooling.CLASSIFY,
    messages.MESSAGES,
    messages.COUNT_TOKENS,
    audio.TRANSCRIPTIONS,
    audio.TRANSLATIONS,
    files.CREATE,
    files.LIST,
    files.RETRIEVE,
    files.DELETE,
    files.CONTENT,
    batches.CREATE,
    batches.LIST,
    batches.RETRIEVE,
    batches.CANCEL,
)


class Registry:
    """Finds the routes of a path: exact paths by lookup, patterned ones in order (the first match wins)."""

    def __init__(self, routes: tuple[Route, ...] = ROUTES) -> None:
        self.exact: dict[str, dict[str, Route]] = {}
        self.patterned: list[tuple[Route, dict[str, Route]]] = []
        for route in routes:
            if route.pattern is None:
                methods = self.exact.setdefault(route.path, {})
            else:
                known = next((m for r, m in self.patterned if r.path == route.path), None)
                if known is None:
                    known = {}
                    self.patterned.append((route, known))
                methods = known
            for method in route.methods:
                if method in methods:
                    raise ValueError(f"{method} {route.path} is declared twice")
                methods[method] = route

    def match(self, path: str) -> tuple[dict[str, Route], dict[str, str]] | None:
        """The routes at `path` by method, and the path's parameters; None for a path no route has."""
        methods = self.exact.get(path)
        if methods is not None:
            return methods, {}
        for route, methods in self.patterned:
            assert route.pattern is not None  # a patterned route, as __init__ sorted them
            found = route.pattern.match(path)
            if found:
                return methods, found.groupdict()
        return None
