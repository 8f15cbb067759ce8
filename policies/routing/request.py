"""What a routing plugin may read of a request: a small immutable view, built once per pick from the call.

A call carries everything every pipeline step learns about it; routing needs five things of it, and a plugin that
sees only these cannot come to depend on the rest (a key's budget, a rate-limit ticket, the trace):
- `model`: the public model name, after alias resolution (prefix-affinity seeds its block hashes with it);
- `endpoint`: the route's name ("chat/completions", "completions"...: precise-prefix renders a chat through the
  model's chat template, a completion's prompt as it is);
- `headers`: the client's request headers, names in lower case (session-affinity hashes its `header` param's
  value, `x-session-id` by default; the variants' stickiness reads its own header before routing, not here);
- `adapter`: the LoRA adapter that serves the request, when its model is one (lora-affinity);
- `prompt`: the prompt as the route declares it (`Route.prompt`): its text, made at most once per pick however
  many scorers read it, and the JSON body it is read from (for a scorer that renders it itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from backends.lora import AdapterTarget
from policies.json_types import JSON

PromptReader = Callable[[Mapping[str, JSON]], str]  # a route's: the text a JSON body's prompt starts with


class Prompt:
    """A request's prompt, read lazily: `text` is what the route's reader makes of the body (empty when the route
    declares no prompt), computed on first use and kept; `body` is the JSON body it comes from. Neither is for
    changing: a plugin reads them."""

    __slots__ = ("body", "_read", "_text")

    def __init__(self, body: Mapping[str, JSON], read: PromptReader | None = None) -> None:
        self.body = body
        self._read = read
        self._text: str | None = None

    @property
    def text(self) -> str:
        text = self._text
        if text is None:
            read = self._read
            text = self._text = read(self.body) if read is not None else ""
        return text


@dataclass(frozen=True, slots=True, init=False)
class RoutingRequest:
    """The request as routing sees it (see the module's docstring)."""

    model: str
    endpoint: str
    headers: Mapping[str, str]
    adapter: AdapterTarget | None
    prompt: Prompt

    def __init__(self, model: str, endpoint: str, headers: Mapping[str, str], adapter: AdapterTarget | None,
                 prompt: Prompt) -> None:
        # Every pick makes one: each field is set once through its slot's own descriptor, half the cost of the
        # object.__setattr__ a frozen dataclass's generated __init__ makes per field (~0.5 µs against ~0.9)
        _SET_MODEL(self, model)
        _SET_ENDPOINT(self, endpoint)
        _SET_HEADERS(self, headers)
        _SET_ADAPTER(self, adapter)
        _SET_PROMPT(self, prompt)


_SET_MODEL, _SET_ENDPOINT, _SET_HEADERS, _SET_ADAPTER, _SET_PROMPT = (
    vars(RoutingRequest)[name].__set__ for name in ("model", "endpoint", "headers", "adapter", "prompt"))


class Routable(Protocol):
    """What a pick is made for: a call (policies/pipeline.py), which makes its own view. Routing knows no more of
    the call than this, so the pipeline may name routing's types and routing never the pipeline's."""

    def routing(self) -> RoutingRequest:
        """The view of this request, for one pick."""

    def routed(self, uncached: float | None) -> None:
        """What the pick found: the prompt tokens the chosen replica likely has to prefill (None: no prefix
        scorer looked)."""


NO_REQUEST = RoutingRequest("", "", {}, None, Prompt({}))  # a pick made without a call (an admission that names none)
