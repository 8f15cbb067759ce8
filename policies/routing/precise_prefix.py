"""Send a request where vLLM itself says its prompt's longest prefix is cached, from vLLM's KV cache events.

Each replica with a `kv_events` source (a static backend's, or every discovered replica's) has a block index
(backends/kv_events.py) that its vLLM keeps exact: blocks stored, evicted, cleared. This scorer turns the request's
prompt into the token ids vLLM will see (the model's own tokenizer and chat template, from the `tokenizer`
directory: tokenizer.json plus the chat template of tokenizer_config.json or chat_template.jinja, rendered as
transformers renders it), cuts them into vLLM's blocks (the block size the events carry) and chains them into
content keys the index shares. A candidate's match is its leading blocks held, each weighed by where: 1 in GPU
memory, `medium_weights` for a block held only offloaded (CPU 0.5, STORAGE 0.25 by default: reloading it costs a
transfer, less than a recompute); its score is that match relative to the best candidate's (the best scores 1;
nothing held anywhere: all 0, load decides). Unlike the approximate scorer it sees evictions, other gateways'
requests and restarts.

What follows the match is prefix-affinity's (policies/routing/prefix_guard.py): a candidate scores its blocks
held beyond what every candidate holds, and the same load guard (`guard`, `imbalance`; its rules are in
prefix_affinity.py) can move the request off the best-holding replica when it queues, its KV cache is full, or
the match is a shared prefix; shared here means that the replica's vLLM holds more than one continuation of the
last matched block (its events say so), or the whole prompt. A replica without events scores 0; a prompt that
cannot be rendered or is shorter than one block scores 0 everywhere (load decides).

The blind start. An index under-reports until it has seen its vLLM's cache from empty (backends/kv_events.py
says when: a fresh subscription, after a lost gap, a failed subscription or the replica down): vLLM may hold
prefixes the index has never heard of. Scoring such a replica by its index would repel every request from it
(it seems to hold nothing), and every request whose prefix a seeing replica holds would go there; scoring it
by a guess of ours could attract them instead. So for `blind_seconds` (default 60; 0: never blind) a blind
candidate counts as holding exactly what the best-matching seeing candidate holds, no more and no less: it
ties with the best, and load (the other scorers, the guard, which judges it as that best one) decides between
them, while a seeing candidate that holds less still loses. When every candidate is blind, all score 0: load
decides. A blind replica thus gets its share of every kind of request, and a seeing one never more than the
prefixes it holds would win it anyway; the decisions counter says `blind` for such picks. After the window the
index is trusted as it is (what vLLM held before still hides until stored again), or at once when its vLLM's
cache was seen from empty (sequence 0, a restart, AllBlocksCleared). A replica with a `kv_events` source whose
subscription has not started yet is blind too.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from backends.kv_events import GPU, prefix_keys
from backends.replicas import KVIndex
from policies.json_types import JSON, JSONObject
from policies.routing.base import Candidate, Note, RoutingMetrics, Stateless, Stats
from policies.routing.prefix_guard import GuardParams, prefix_scores
from policies.routing.request import RoutingRequest

log = logging.getLogger("gateway.routing")


MEDIUM = r"^[A-Za-z0-9_-]{1,32}$"


class PrecisePrefixParams(GuardParams):
    tokenizer: str = Field("", max_length=4096)  # the served model's directory (tokenizer.json, its chat template)
    max_blocks: int = Field(4096, ge=1, le=1_000_000)  # blocks looked up per request (longer prompts: the start)
    # what a block held in that medium counts for (vLLM's GPU, CPU, STORAGE); one in GPU memory counts 1 unless
    # listed; a medium not listed counts as the lowest listed
    medium_weights: dict[Annotated[str, StringConstraints(pattern=MEDIUM)], Annotated[float, Field(ge=0, le=1)]] = \
        Field(default_factory=lambda: {GPU: 1.0, "CPU": 0.5, "STORAGE": 0.25}, max_length=16)
    # how long a replica whose index may know less than its vLLM holds is scored as the best match (0: never)
    blind_seconds: float = Field(60.0, ge=0, le=3600)

    @field_validator("medium_weights")
    @classmethod
    def upper_case(cls, weights: dict[str, float]) -> dict[str, float]:
        return {medium.upper(): weight for medium, weight in weights.items()}


class PrecisePrefix(Stateless):
    """vLLM's events say what is cached: a pick teaches nothing (Stateless)."""

    name = "precise-prefix"
    Params = PrecisePrefixParams

    def __init__(self, params: PrecisePrefixParams | None = None, metrics: RoutingMetrics | None = None) -> None:
        self.params = params or PrecisePrefixParams()
        weights = self.params.medium_weights
        self.unlisted = min(weights.values(), default=1.0)

    def weight(self, medium: str) -> float:
        return self.params.medium_weights.get(medium, 1.0 if medium == GPU else self.unlisted)

    def tokens(self, request: RoutingRequest) -> list[int] | None:
        if not self.params.tokenizer:
            return None
        prompt = load_prompt_tokenizer(self.params.tokenizer)
        return None if prompt is None else prompt.tokens(request.endpoint, request.prompt.body)

    def blind(self, replica: Candidate, now: float) -> bool:
        """Its index may know less than its vLLM holds (see the module's docstring), within `blind_seconds`."""
        window = self.params.blind_seconds
        if replica.kv_index is None:
            return replica.kv_events is not None and window > 0
        return bool(replica.kv_index.blind(window, now))

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate], stats: Stats, note: Note) -> list[float]:
        now = time.monotonic()
        blind = [self.blind(r, now) for r in candidates]
        if all(blind):
            note.outcome = "blind"
            return [0.0] * len(candidates)
        # each candidate's index and its block size, where it has one that knows its block size (and is not blind)
        sized: list[tuple[KVIndex, int] | None] = [
            (i, i.block_size) if i is not None and i.block_size and not b else None
            for i, b in ((r.kv_index, b) for r, b in zip(candidates, blind))]
        sizes = {s[1] for s in sized if s is not None}
        tokens = self.tokens(request) if sizes else None
        if not tokens:
            note.outcome = "blind" if any(blind) else "no_events" if not sizes else "no_prompt"
            return [0.0] * len(candidates)
        keys = {size: prefix_keys(tokens, size, self.params.max_blocks) for size in sizes}
        counts = [0 if s is None else s[0].matched(keys[s[1]]) for s in sized]
        matched = [float(n) if not n or s is None else s[0].weighed(keys[s[1]], n, self.weight)
                   for s, n in zip(sized, counts)]
        stand_in = list(range(len(candidates)))  # whose match each candidate's counts as (a blind one: the best's)
        if any(blind):
            best = max((i for i, b in enumerate(blind) if not b), key=lambda i: matched[i])
            for i, b in enumerate(blind):
                if b:
                    stand_in[i], counts[i], matched[i] = best, counts[best], matched[best]

        def shared(n: int) -> bool:
            m = stand_in[n]
            found, held = sized[m], counts[m]
            if found is None:  # no index: nothing matched (prefix_scores asks only of a match)
                return False
            index, size = found
            mine = keys[size]
            return held == len(mine) or index.shared(mine[held - 1])

        # (the candidates serve one model: their block sizes are alike; the smallest stands for the prompt's)
        block = float(min(sizes))
        seen = [stats.vllm(r) for r in candidates]
        scores = prefix_scores(self.params, seen, [stats.load(r, s) for r, s in zip(candidates, seen)], matched,
                               float(len(tokens)), block, shared, note)
        if any(blind):
            note.outcome = "blind"
        return scores


class PromptTokenizer:
    """The token ids vLLM makes of a request: chat messages through the chat template, then the tokenizer."""

    def __init__(self, directory: Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config: JSONObject = {}
        if (directory / "tokenizer_config.json").exists():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if not isinstance(template, str) and (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if isinstance(template, str) else None

    def tokens(self, endpoint: str, body: Mapping[str, JSON]) -> list[int] | None:
        try:
            if endpoint == "chat/completions" and self.template is not None:
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                text = self.template.render(messages=messages, tools=body.get("tools"), add_generation_prompt=True,
                                            **self.special)
                return self.tokenizer.encode(text, add_special_tokens=False).ids
            if endpoint == "completions" and isinstance(body.get("prompt"), str):
                return self.tokenizer.encode(body["prompt"]).ids
        except Exception:  # a template error on odd messages: this request is routed by load
            return None
        return None


@functools.lru_cache(maxsize=8)
def load_prompt_tokenizer(directory: str) -> PromptTokenizer | None:
    try:
        return PromptTokenizer(Path(directory))
    except Exception as exc:  # missing or unreadable files: said once, routed by load
        log.warning("precise-prefix: cannot load the tokenizer in %s (%s); routing by load", directory, exc)
        return None


def _token_text(value: JSON) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise ValueError(message)
