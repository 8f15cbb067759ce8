"""The request path, top to bottom: parse -> pipeline steps -> pick a replica -> forward -> relay -> account.

Every route runs the same path; what differs between them (body kind, model, token estimate, usage, stream
relay, pinned replica) is read from the call's route declaration (gateway/endpoints/).

Framework-free on purpose: the HTTP layer (gateway/openai_routes.py) hands over the body and gets a `Reply`
back, so the path can be read, tested and measured on its own. A streamed Reply must be closed by the HTTP
layer (`Reply.close`), however the stream ended: that closes the upstream connection (so vLLM aborts the
request) and accounts for the call exactly once.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import orjson

from backends.http1 import Client, ConnectFailed, ReadTimedOut, Response, TooLarge, WriteTimedOut
from backends.lora import LoadFailed, LoraAdapters
from backends.rented import RentedProviders
from backends.replicas import Replica, ReplicaSet
from backends.upstream import UpstreamError
from gateway import migration, responses_replay, stream_replay
from gateway.attempts import Attempts, failure_of, status_failure
from gateway.endpoints.base import JSON, MULTIPART, NONE, ROUTE, parse_json
from gateway.fallbacks import Fallbacks
from gateway.http.form_upload import UPLOAD, FormUpload
from gateway.relay import EventRelay, SSERelay, model_rename
from gateway.shadow import Shadow
from gateway.tracing import Off, Tracing
from policies import prefill_order
from policies.admission import Admission, WouldWait
from policies.budget import BEFORE_RENT
from policies.config import Overflow
from policies.errors import (
    BadRequest,
    GatewayError,
    NoBackendAvailable,
    NotRentable,
    OverBudget,
    UpstreamFailed,
    UpstreamStatus,
    upstream_text,
    UpstreamTimeout,
)
from policies.finished import Observers, record_of
from policies.ids import unique_id
from policies.json_types import JSONObject, JSONView
from policies.metrics import GatewayMetrics
from policies.pipeline import Call, Pipeline
from policies.priority import CLIENT_PRIORITY
from policies.tokens import CHARS_PER_TOKEN
from policies.variant_signals import ANSWER
from policies.variants import SHADOW

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# what a secret looks like: an API key (ours `sk-<id>-<secret>`, a provider's sk-/rk-/pk- ones), a JWT, or a long run
# of mixed-case letters and digits (a random token); a request id so shaped is replaced, never logged or echoed
SECRET_SHAPE = re.compile(r"(?i:(?:^|[^a-z0-9])(?:sk|rk|pk)-[a-z0-9_-]{8,})|eyJ[A-Za-z0-9_-]{8,}"
                          r"|(?=[A-Za-z0-9]{24})(?=[a-z0-9]*[A-Z])(?=[A-Z0-9]*[a-z])[A-Za-z]*[0-9]")
TIMED_OUT = (ReadTimedOut, WriteTimedOut)
# a stream's record of what went to the client, by how it goes on elsewhere: continued (chat, completions) or
# asked again and cut (Messages, Responses)
Moving = migration.Migration | stream_replay.Replay | responses_replay.ResponsesReplay


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[BaseException | None], Awaitable[None]] | None = None


def request_id_from(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id when it is a plain id; a new one when it is missing, malformed, or looks like a
    secret (a key pasted in the wrong header must not reach the access log, traces or the backend)."""
    given: str | None = headers.get("x-request-id")
    if given and REQUEST_ID.match(given) and not SECRET_SHAPE.search(given):
        return given
    return unique_id()


class Proxy:
    def __init__(
        self,
        replicas: ReplicaSet,
        admission: Admission,
        pipeline: Pipeline,
        metrics: GatewayMetrics,
        client: Client,
        rented: RentedProviders,
        overflow: dict[str, Overflow],
        observers: Observers | None = None,
    ) -> None:
        self.replicas = replicas
        self.admission = admission
        self.pipeline = pipeline
        self.metrics = metrics
        self.rented = rented
        self.overflow = {model: rule for model, rule in overflow.items() if model in rented.targets}
        self.client = client
        rented.connect(client)
        self.renames: dict[tuple[str, str], tuple[bytes, bytes] | None] = {}  # (served, public) -> model_rename
        self.observers = observers or Observers(())  # the snapshot's observers of finished calls
        self.tracing: Tracing = Off()  # gateway/tracing/__init__.py: set by the app from the policy's `tracing`
        self.shadow: Shadow | None = None  # gateway/shadow.py: set by the app when a model has a shadow variant
        self.loras: LoraAdapters | None = None  # backends/lora.py: set by the app; loads adapters on demand
        # asked right before every rent: does the key's current record still allow it? (policies/auth.py)
        self.rent_check: Callable[[Call], Awaitable[bool]] | None = None
        # retries on another replica and outlier ejection (gateway/attempts.py): set by the app from the policy
        self.attempts = Attempts(replicas, metrics)
        # fallback chains (gateway/fallbacks.py): set by the app from the policy
        self.fallbacks: Fallbacks | None = None

    async def handle(self, call: Call, raw_body: bytes | AsyncIterator[bytes], raw_query: bytes = b"") -> Reply:
        """Serve one request of `call.route`; raises GatewayError for anything the client must see as an error.
        A multipart route's body comes as its chunks (it is streamed through), any other's whole; `raw_query`,
        the client's query string, matters only to a route that forwards it."""
        route = ROUTE.of(call)
        try:
            if route.query is not None:
                call.query = route.query(raw_query)
            if route.body == JSON:
                assert isinstance(raw_body, bytes)  # a JSON route's body comes whole
                call.body = parse_json(raw_body)
            elif route.body == MULTIPART:
                assert not isinstance(raw_body, bytes)  # a multipart route's comes as its chunks
                upload = FormUpload(raw_body, call.request.headers.get("content-type", ""))
                UPLOAD.put(call, upload)
                call.body = await upload.read_head()
            if route.pin is not None:
                call.pinned = route.pin(call, self.replicas)
            call.asked_model = route.model(call)
            call.tokens = route.tokens
            await self.pipeline.enter(call)
            if call.pinned is not None and call.pinned.model != call.model:
                raise BadRequest(f"that response was made by model {call.pinned.model}, not {call.model}",
                                 param="previous_response_id", code="model_mismatch")
            call.stream = route.streams(call.body)
            if call.stream and route.stream_usage:  # read before a send asks for the usage chunk (any retry's too)
                options = call.body.get("stream_options")
                call.wants_usage = isinstance(options, dict) and options.get("include_usage") is True
            response = await self.forward(call)
            if route.stream_by_answer:  # a form's stream field may follow its file, a retrieve's is in its query
                call.stream = is_event_stream(response)
            if call.stream and response.status == 200:
                return Reply(
                    200,
                    self.reply_headers(call, response),
                    stream=self.relay(call, response),
                    close=partial(self.close_stream, call, response),
                )
            if response.status == 200 and self.shadow is not None and SHADOW.get(call) is not None:
                self.shadow.start(call)  # the live answer is under way: its copy may go now
            reply = await self.read_whole(call, response)
        except BaseException as exc:
            await self.finish(call, exc)
            raise
        await self.finish(call, None)
        return reply

    async def forward(self, call: Call) -> Response:
        """`forward_model`; when it fails (every replica down, the attempts failed, the model full) and the model
        has a fallback chain, the chain's steps in order (gateway/fallbacks.py)."""
        fallbacks = self.fallbacks
        try:
            response = await self.forward_model(call)
        except GatewayError as exc:
            if fallbacks is None or call.model not in fallbacks.chains:
                raise
            return await fallbacks.after(self, call, exc)
        if (response.status >= 500 or response.status == 429) and fallbacks is not None \
                and call.model in fallbacks.chains:
            return await fallbacks.after(self, call, response)
        return response

    async def forward_model(self, call: Call, rent: bool = True) -> Response:
        """Send to the best owned replica with room (waiting for one if needed); when the attempt fails before its
        answer's head is relayed (a connect failure, a reset, no head in time, a 5xx or 429), to another one, as
        gateway/attempts.py allows. A key allowed to rent may spill to the model's rented provider instead of
        waiting long, when no owned replica is up, or when the owned attempts failed to connect (unless `rent` is
        false: a fallback step's model serves from its replicas alone)."""
        tried: list[Replica] = []
        others: list[Replica] = []  # a pinned call can be served by its replica alone
        if call.pinned is not None:
            others = [r for r in self.replicas.by_model[call.pinned.group] if r is not call.pinned]
        owner = call.key.id if call.key is not None else call.client_host
        overflow = self.overflow.get(call.model) if rent and self.may_rent(call) else None
        attempts = self.attempts
        attempts.started(call.model, call.request.arrived)
        # bounded: each pass sends to a replica not tried before, at most 1 + retries.attempts of them (Attempts.retry);
        # a pass that sends nothing either returns, raises, or drops the overflow (at most once)
        while True:
            before = time.perf_counter()
            try:
                replica = await self.admission.acquire(
                    call.group or call.model, owner, exclude=tried + others,
                    spill_after=overflow.when_wait_exceeds if overflow else None, call=call,
                )
            except WouldWait:
                try:
                    return await self.rent(call, before)
                except (OverBudget, NotRentable):  # the key may not rent (any more): wait for an owned replica
                    overflow = None
                    continue
            except NoBackendAvailable:
                if overflow is not None and (tried or overflow.when_unavailable):
                    return await self.rent(call, before)
                if not tried:
                    raise
                break
            waited = time.perf_counter() - before
            call.queue_wait += waited
            call.response_headers["x-gateway-queue-ms"] = f"{waited * 1000:.1f}"
            if not tried and not call.sent_at:  # the gateway's own time before the first send, not the queue
                call.overhead += before - call.request.arrived
            tried.append(replica)
            call.load = replica.server_in_flight  # every group's calls to its server: variants may share one
            try:
                if call.adapter is not None and self.loras is not None:
                    await self.load_adapter(call, replica)
                response = await self.send(call, replica, holds=True)
                if response.status == 404 and call.adapter is not None and self.loras and "model" in call.body:
                    response = await self.reload_adapter(call, replica, response)
            except UpstreamError as exc:
                self.upstream_failed(replica, exc, str(exc))
                self.release(call)
                reason = failure_of(exc)
                if reason is not None and attempts.retry(call, reason, tried, tried + others):
                    continue
                if isinstance(exc, ConnectFailed):
                    break  # it reached no backend: the overflow, or "not reachable"
                raise upstream_error(exc, f"the backend for model {call.model}") from None
            status = response.status
            if status < 500 and status != 429:
                self.replicas.succeeded(replica)
                if replica.outlier is not None:
                    attempts.ejections.succeeded(replica)
                return response
            if status >= 500:
                self.upstream_failed(replica, None, f"HTTP {status}")
            if attempts.retry(call, status_failure(status), tried, tried + others):
                response.close()
                self.release(call)
                continue
            return response
        if overflow is not None:
            return await self.rent(call, time.perf_counter())
        raise NoBackendAvailable(f"no backend of model {call.model} is reachable; try again shortly")

    async def load_adapter(self, call: Call, replica: Replica) -> None:
        """Make sure the chosen replica holds the call's LoRA adapter, waiting (bounded) for its load; the call
        holds its slot meanwhile, so a load counts against the cap like the request it is for."""
        loras, adapter = self.loras, call.adapter
        assert loras is not None and adapter is not None  # the caller checked
        call.replica, call.holds_replica = replica, True  # released by finish() whatever happens below
        loras.using(replica, adapter.lora_name)
        try:
            if await loras.ensure(self.client, replica, adapter):
                call.response_headers["x-gateway-lora-load"] = replica.name
        except LoadFailed as exc:
            error = UpstreamTimeout if exc.timed_out else UpstreamFailed
            raise error(f"model {call.model}: {exc}", code="adapter_load_failed") from None

    async def reload_adapter(self, call: Call, replica: Replica, response: Response) -> Response:
        """vLLM does not know the adapter it was said to hold (it restarted since its /v1/models was read):
        load it again and send once more."""
        response.close()
        loras, adapter = self.loras, call.adapter
        assert loras is not None and adapter is not None  # the caller checked
        loras.forget(replica, adapter.lora_name)
        loras.done(replica, adapter.lora_name)  # load_adapter counts the call in again
        await self.load_adapter(call, replica)
        return await self.send(call, replica, holds=True)

    def may_rent(self, call: Call) -> bool:
        """Only keys whose data policy allows it (and whose budget does), only for models with a rented overflow,
        only on routes OpenAI's API has, and never for a call pinned to its replica."""
        return (call.key is not None and call.key.data_policy == "allow_rented" and call.rent_allowed
                and call.model in self.overflow and ROUTE.of(call).rentable and call.pinned is None)

    async def rent(self, call: Call, since: float, target: Replica | None = None) -> Response:
        """Serve from the model's rented provider (or `target`, a fallback chain's rented step): one attempt, no
        retries (it is the last resort). The key's current record is asked first: the decision taken at admission
        may be stale by now."""
        target = target or self.rented.targets[call.model]
        if self.rent_check is not None and not await self.rent_check(call):
            call.rent_allowed = False
            self.metrics.rent_refused.labels(call.model, "data_policy").inc()
            raise NotRentable(f"no backend of model {call.model} is available, and this API key may no longer "
                              "use a rented provider")
        before_rent = BEFORE_RENT.get(call)
        if before_rent is not None and not await before_rent():
            raise OverBudget(f"no backend of model {call.model} has room and this key's rented budget is spent")
        if call.overhead == 0:
            call.overhead += since - call.request.arrived
        try:
            response = await self.send(call, target, holds=False)
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(call.model, target.name, exc.kind).inc()
            raise upstream_error(exc, f"the rented provider for model {call.model}") from None
        if response.status in (401, 403):  # its message may quote the provider key: never relay it
            response.close()
            raise UpstreamFailed(f"the rented provider for model {call.model} refused the gateway's credentials")
        return response

    async def send(self, call: Call, target: Replica, holds: bool, body: JSONView | None = None) -> Response:
        """Open the request to `target`, an owned replica (whose slot the call `holds`) or the rented provider;
        raises UpstreamError. The response's status and headers are in when it returns. `body`: a JSON body to
        send instead of the call's (a moved stream's continuation)."""
        call.replica, call.holds_replica = target, holds
        route = ROUTE.of(call)
        path = route.upstream_path(call.request.params)
        if call.query:
            path += call.query
        trace_headers = self.tracing.sending(call, target)  # records the attempt's span either way
        if target.rented and target.rented not in self.rented.trace_context:
            trace_headers = b""  # a rented provider hears of the trace only where the policy says so
        call.sent_at = time.perf_counter()
        upstream = target.upstream or target.connect(self.client)
        if route.body == MULTIPART:
            served = target.served_name if "model" in call.body else None
            return await upstream.open(path, b"", call.request.id, content_type=call.request.headers[
                "content-type"], stream=UPLOAD.of(call).upload(served), extra=trace_headers)
        raw = self.upstream_body(call, target, call.body if body is None else body) if route.body == JSON else b""
        method = "POST" if route.body != NONE else route.methods[0]
        return await upstream.open(path, raw, call.request.id, method, extra=trace_headers)

    def rename(self, call: Call) -> tuple[bytes, bytes] | None:
        """How the served model name (the replica's, or the call's LoRA adapter's) is told back as the public
        one in its answers (None: the same)."""
        names = self.served_names(call)
        try:
            return self.renames[names]
        except KeyError:
            found = self.renames[names] = model_rename(*names)
            return found

    def upstream_body(self, call: Call, target: Replica, body: JSONView) -> bytes:
        """The client's body untouched but for `model`, on streams the usage the gateway needs, whatever the
        route adds for the chosen replica (a Responses id that leads back to it), and the priority class as
        vLLM's `priority` for a backend that schedules by it, cheapest prefill first within the class
        (policies/prefill_order.py; the Classify step already dropped a `priority` the key may not send; a rented
        API never gets one). `body` is the call's, or what goes instead of it: it is
        copied, never changed (each attempt starts from the client's)."""
        body = dict(body)
        route = ROUTE.of(call)
        if "model" in body:
            body["model"] = call.adapter.lora_name if call.adapter is not None and not target.rented \
                else target.served_name
        own = CLIENT_PRIORITY.get(call)
        if target.rented:
            body.pop("priority", None)
        elif own is not None:  # the client's own, which its key may send (clamped to its class)
            body["priority"] = own
        elif target.priority_scheduling and call.priority is not None:
            body["priority"] = prefill_order.vllm_priority(call, call.priority)
        else:
            body.pop("priority", None)
        if call.stream:  # a stream that may move token-exactly asks the replica for its token ids
            migration.ask_for_ids(call, body, route, self.attempts.migrations(call.model), bool(target.rented))
        if call.stream and route.stream_usage:
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            body["stream_options"] = options
        if route.prepare is not None:
            route.prepare(call, body, target)
        return orjson.dumps(body)

    async def read_whole(self, call: Call, response: Response) -> Reply:
        assert call.replica is not None  # sent: the call holds its replica
        try:
            raw = await response.read(self.client.limits.body_bytes)
        except UpstreamError as exc:
            self.upstream_failed(call.replica, exc, str(exc))
            raise upstream_error(exc, f"the {_side(call)} for model {call.model}", "broke off the response") \
                from None
        finally:
            response.close()
        received = time.perf_counter()
        if call.replica.rented:  # a provider may quote its key back (an error, a field): it goes no further
            raw = self.rented.scrub(raw)
        status = response.status
        if status >= 500:
            raise UpstreamFailed(f"the backend for model {call.model} failed (HTTP {status}): {upstream_text(raw)[1]}")
        if status >= 400:
            raise UpstreamStatus(status, raw)
        if ROUTE.of(call).plain_text and not response.headers.get("content-type", "").startswith("application/json"):
            return Reply(status, self.reply_headers(call, response), body=raw)  # text, srt, vtt transcripts
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamFailed(f"the {_side(call)} for model {call.model} sent a response that is not JSON") \
                from None
        if isinstance(data, dict):
            call.response = data
            call.usage = ROUTE.of(call).usage(data)
            if call.usage is None and call.replica.rented:  # paid for all the same
                call.usage = estimated_usage(call, len(raw) // CHARS_PER_TOKEN)
            if self.rename(call) is not None and data.get("model") == self.served_names(call)[0]:
                data["model"] = call.model
                raw = orjson.dumps(data)
        call.overhead += time.perf_counter() - received
        return Reply(status, self.reply_headers(call, response), body=raw)

    async def relay(self, call: Call, response: Response) -> AsyncIterator[bytes]:
        """The upstream's SSE bytes as they come; a backend failure mid-stream goes on from another replica where
        the model and the request allow it (gateway/migration.py), else becomes a final error event."""
        assert call.replica is not None  # sent: the call holds its replica
        relay = ROUTE.of(call).relay_of(call, self.rename(call))
        relay.max_event = self.client.limits.event_bytes
        answer = ANSWER.get(call)  # a variant's signals, read from the events as they pass
        # a rented provider may quote its key back: scrubbed from whole events (a key cut between two chunks is
        # whole again there), before the client, the tap (spans) or a variant's signals see them
        scrub = self.rented.scrub if call.replica.rented else None
        # what went to the client, kept only where the stream may move (None: the hot path as it was)
        moving: Moving | None = None
        if scrub is None and not relay.replay:
            allowed = self.attempts.migrations(call.model)
            moving = migration.watch(ROUTE.of(call), call.body, allowed, hide=migration.ASKED.get(call) is True) \
                or stream_replay.watch(ROUTE.of(call), call.body, allowed) \
                or responses_replay.watch(ROUTE.of(call), call.body, allowed)
        first = True
        try:
            while True:  # bounded: a pass per attempt, each a move that Migration.left allows (at most 5)
                try:
                    while not relay.ended and (chunk := await response.next_chunk()):
                        if first:
                            first = False
                            now = call.first_token_at = time.perf_counter()
                            if not relay.replay:  # stored events come at once: no measure of the backend's pace
                                self.metrics.first_token(call.model, now - call.request.arrived)
                                self.admission.observe(call.replica, now - call.sent_at)
                                self.attempts.ejections.ttft(call.replica, now - call.sent_at)
                            if self.shadow is not None and SHADOW.get(call) is not None:
                                self.shadow.start(call)  # the live answer is under way: its copy may go now
                        if call.tap is not None and scrub is None:
                            call.tap.append(chunk)
                        out = relay.feed(chunk)
                        if scrub is not None and out:
                            out = scrub(out)
                            if call.tap is not None:
                                call.tap.append(out)
                        if moving is not None and out:
                            out = moving.feed(out)
                        if out:
                            if answer is not None:
                                answer.feed(out)
                            yield out
                    tail = relay.flush()
                    if scrub is not None and tail:
                        tail = scrub(tail)
                        if call.tap is not None:
                            call.tap.append(tail)
                    if moving is not None and tail:
                        tail = moving.feed(tail)
                    if tail:
                        if answer is not None:
                            answer.feed(tail)
                        yield tail
                    break
                except UpstreamError as exc:
                    if moving is None or not migration.movable(exc):
                        raise
                    event = exc if isinstance(exc, migration.ErrorEvent) else None
                    if event is not None and event.passed:
                        if answer is not None:
                            answer.feed(event.passed)
                        yield event.passed
                    failed = call.replica
                    moved = await self.move_stream(call, moving, relay)
                    if moved is None:
                        if event is None:
                            raise
                        moving.stop()  # the error event goes on as it came, and the stream ends as it does
                        if answer is not None:
                            answer.feed(event.rest)
                        yield event.rest
                        continue
                    self.upstream_failed(failed, None if event is not None else exc, str(exc))
                    response.close()  # a stalled replica stops generating for nobody
                    response, relay = moved
        except UpstreamError as exc:
            if relay.replay:  # vLLM ends a replay of a response that has no stored events so: no sign of ill health
                call.error = UpstreamFailed(f"the backend for model {call.model} ended the stream early (only a "
                                            "response made with background and stream set has events to stream)")
            else:
                self.upstream_failed(call.replica, exc, str(exc))
                call.error = upstream_error(exc, f"the {_side(call)} for model {call.model}", "broke off the stream")
            yield relay.error_frame(ROUTE.of(call).errors(call.error))
        finally:
            call.usage = relay.usage if moving is None or relay.usage is None else moving.summed(relay.usage)
            call.streamed_events = relay.events
            if relay.usage is None and call.replica.rented and not relay.replay:
                call.usage = estimated_usage(call, relay.events)
            response.close()  # a continuation's (the first attempt's is closed by close_stream as well)

    async def move_stream(self, call: Call, moving: Moving,
                          relay: SSERelay | EventRelay) -> tuple[Response, SSERelay | EventRelay] | None:
        """The stream's replica failed mid-body: send the continuation to another replica (gateway/migration.py).
        Returns its answer and relay, or None where the stream cannot move (each outcome counted)."""
        body = moving.continuation(call.body) if moving.may_move() else None
        if body is None:  # refused (the request, what was relayed, nothing left to generate), or no moves left
            outcome = migration.EXHAUSTED if moving.refused is None and moving.left <= 0 else migration.UNFAITHFUL
            self.metrics.stream_migrations.labels(call.model, outcome).inc()
            return None
        failed = call.replica
        assert failed is not None  # a stream under way was sent
        self.release(call)
        owner = call.key.id if call.key is not None else call.client_host
        response = None
        route = ROUTE.of(call)
        sent_as = moving.sent_as(route)  # a chat that goes on token-exactly: a completion of its tokens
        try:
            replica = await self.admission.acquire(call.group or call.model, owner, exclude=[failed], call=call)
            if call.adapter is not None and self.loras is not None:
                await self.load_adapter(call, replica)  # the LoRA adapter, on the replica that goes on
            ROUTE.put(call, sent_as)
            response = await self.send(call, replica, holds=True, body=body)
        except (GatewayError, UpstreamError) as exc:
            if isinstance(exc, UpstreamError):
                self.upstream_failed(call.replica, exc, str(exc))
        finally:
            ROUTE.put(call, route)
        if response is None or response.status != 200:
            if response is not None:
                response.close()
            self.release(call)
            call.replica = failed  # the record names the replica that failed the stream
            self.metrics.stream_migrations.labels(call.model, migration.FAILED).inc()
            return None
        moving.moved(relay.usage, as_chat=sent_as is not route)
        call.response_headers[migration.MIGRATIONS_HEADER] = str(moving.moves)
        self.metrics.stream_migrations.labels(call.model, migration.CONTINUED).inc()
        moved = ROUTE.of(call).relay_of(call, self.rename(call))
        moved.max_event = self.client.limits.event_bytes
        return response, moved

    async def close_stream(self, call: Call, response: Response, error: BaseException | None) -> None:
        response.close()  # an unfinished stream drops the connection, and vLLM aborts the request
        await self.finish(call, error or call.error)

    @staticmethod
    def served_names(call: Call) -> tuple[str, str]:
        """(the name the upstream answers with, the public name the client asked for)"""
        replica = call.replica
        assert replica is not None  # named once the call has a replica
        if call.adapter is not None and not replica.rented:
            return call.adapter.lora_name, call.model
        return replica.served_name, replica.model

    def release(self, call: Call) -> None:
        if call.replica is not None and call.holds_replica:
            call.holds_replica = False
            if call.adapter is not None and self.loras is not None:
                self.loras.done(call.replica, call.adapter.lora_name)
            self.admission.release(call.replica, call)

    def upstream_failed(self, replica: Replica | None, error: UpstreamError | None, reason: str) -> None:
        """Count a failed exchange (`error`, or None for a 5xx answer), and mark the replica down for those that say
        it is unwell: a refused connection, a broken exchange (invalid HTTP, a close mid-answer), a head past its
        bound, a 5xx. Not a timeout (a long generation is no illness) nor a body or event past its bound: its
        size follows the request (a huge prompt echoed, many logprobs), so the client's own request must not take
        a replica out. A 5xx or a timeout counts toward outlier ejection (policies/ejection.py)."""
        if replica is None or replica.rented:
            return
        self.metrics.upstream_errors.labels(replica.model, replica.name,
                                            "status_5xx" if error is None else error.kind).inc()
        if error is None or isinstance(error, ReadTimedOut):
            self.attempts.ejections.failed(replica)
        if not isinstance(error, (*TIMED_OUT, TooLarge)):
            self.replicas.failed(replica, reason)

    async def finish(self, call: Call, error: BaseException | None) -> None:
        """Account for a call exactly once: release the replica, leave the pipeline, and publish its record to
        the observers (policies/finished.py: metrics, access log, usage, ledger, traces...)."""
        if call.finished:
            return
        call.finished = True
        call.error = error
        if isinstance(error, GatewayError):
            call.status = error.status
        elif error is not None:
            cancelled = isinstance(error, (asyncio.CancelledError, GeneratorExit))
            call.status = 499 if cancelled else 500  # 499: the client closed the request
        elif not call.status:
            call.status = 200
        self.release(call)
        await self.pipeline.leave(call)
        self.observers.finished(record_of(call, self.rented.cost))

    def reply_headers(self, call: Call, response: Response) -> dict[str, str]:
        assert call.replica is not None  # answered by its replica
        headers = {"x-request-id": call.request.id, **call.response_headers,
                   "x-gateway-served-by": "rented" if call.replica.rented else "owned"}
        content_type = response.headers.get("content-type")
        if content_type:
            headers["content-type"] = self.rented.scrub_text(content_type) if call.replica.rented else content_type
        return headers


def is_event_stream(response: Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def upstream_error(exc: UpstreamError, who: str, failed: str | None = None) -> GatewayError:
    """A failed exchange with an upstream, as the client sees it: 504 for a timeout, else 502. `who` names the
    upstream; a bound crossed is told as it is (the message names the setting), anything else only by what
    `failed` (default: by its class)."""
    error = UpstreamTimeout if isinstance(exc, TIMED_OUT) else UpstreamFailed
    if exc.bound:
        return error(f"{who} {exc}")
    return error(f"{who} {failed or what_failed(exc)}")


def what_failed(exc: UpstreamError) -> str:
    if isinstance(exc, ConnectFailed):
        return "could not be reached"
    if isinstance(exc, TIMED_OUT):
        return "timed out"
    if isinstance(exc, TooLarge):
        return "answered past the gateway's limits"
    return "broke off the exchange"


def estimated_usage(call: Call, completion: int) -> JSONObject:
    """A rented answer without usage is still paid for: charge the prompt's estimate and `completion` tokens
    (one per event relayed, or per 4 bytes of a whole answer; at least one), marked `estimated` so the ledger
    says so. Never zero."""
    prompt = call.tokens.prompt(call.body) if isinstance(call.body, dict) else 0
    return {"prompt_tokens": prompt, "completion_tokens": max(1, completion), "estimated": True}


def _side(call: Call) -> str:
    return "rented provider" if call.replica is not None and call.replica.rented else "backend"
