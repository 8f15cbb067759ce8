"""The gateway's Prometheus metrics, on a registry of its own so several gateways can live in one process.

Labels carry only model and backend names, statuses and error kinds: never keys, tokens or client data.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from policies.finished import RENTED, Finished
from policies.ledger.gauges import ReportGauges
from policies.memo import Memo
from policies.tally import TallyCounter, TallyHistogram

# the *_created series double the scrape size and no dashboard reads them
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
PLUGIN_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)  # a plugin takes microseconds


class GatewayMetrics:
    name = "metrics"  # as an observer of finished calls (policies/finished.py)

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        # every finished call moves these: tallied in plain dicts (policies/tally.py), read at exposition
        self.requests = TallyCounter(
            "llm_gateway_requests", "Requests answered, by public model, backend, HTTP status and endpoint (the"
            " route's name: chat/completions, responses, tokenize, rerank...).",
            ("model", "backend", "status", "endpoint"),
        )
        self.request_duration = TallyHistogram(
            "llm_gateway_request_duration_seconds", "End-to-end request latency as the client sees it.",
            ("model",), LATENCY_BUCKETS,
        )
        self.time_to_first_token = TallyHistogram(
            "llm_gateway_time_to_first_token_seconds", "Time from request arrival to the first streamed chunk.",
            ("model",), LATENCY_BUCKETS,
        )
        self.overhead = TallyHistogram(
            "llm_gateway_overhead_seconds",
            "Time the gateway itself adds: before the upstream request is sent plus handling of the upstream"
            " response, excluding time spent waiting on the backend.",
            ("model",), OVERHEAD_BUCKETS,
        )
        self.prompt_tokens = TallyCounter(
            "llm_gateway_prompt_tokens", "Prompt tokens reported by backends.", ("model", "backend"))
        self.completion_tokens = TallyCounter(
            "llm_gateway_completion_tokens", "Completion tokens reported by backends.", ("model", "backend"))
        self.served = TallyCounter(
            "llm_gateway_served_requests", "Requests answered successfully, by where: owned or rented.",
            ("model", "served_by"),
        )
        self.served_tokens = TallyCounter(
            "llm_gateway_served_tokens", "Prompt plus completion tokens, by where they were served.",
            ("model", "served_by"),
        )
        for tally in (self.requests, self.request_duration, self.time_to_first_token, self.overhead, self.prompt_tokens,
                      self.completion_tokens, self.served, self.served_tokens):
            r.register(tally)
        self.in_flight = Gauge(
            "llm_gateway_backend_in_flight_requests", "Requests the gateway has in flight to each backend.",
            ["model", "backend"], registry=r,
        )
        self.upstream_errors = Counter(
            "llm_gateway_upstream_errors", "Failures talking to a backend, by kind.",
            ["model", "backend", "kind"], registry=r,
        )
        self.backend_up = Gauge(
            "llm_gateway_backend_up", "1 when the backend is routable (up or not yet checked), 0 when down.",
            ["model", "backend"], registry=r,
        )
        self.rate_limited = Counter(
            "llm_gateway_rate_limited", "Requests refused by a rate limit, by model, scope type and limit kind.",
            ["model", "scope", "kind"], registry=r,
        )
        self.queue_depth = Gauge(
            "llm_gateway_queue_depth", "Requests waiting in this process for a backend slot, per model and priority"
            " class.", ["model", "class"], registry=r,
        )
        self.queue_wait = Histogram(
            "llm_gateway_queue_wait_seconds", "Time admitted requests waited for a backend slot, per priority class.",
            ["model", "class"], buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.slots_held = Gauge(
            "llm_gateway_backend_slots_held", "Slots of a backend's cap held across every gateway replica (Redis"
            " store; as last seen by this one), or by this process (embedded store).", ["model", "backend"],
            registry=r,
        )
        self.cap_store_failures = Counter(
            "llm_gateway_cap_store_failures_total", "Admissions made or refused while the shared slot store was"
            " unreachable: fail_open counted them in this process alone (the fleet may exceed a cap), fail_closed"
            " refused them.", ["model", "mode"], registry=r,
        )
        self.cap_leases_lost = Counter(
            "llm_gateway_cap_leases_lost_total", "Slot leases found expired while their request still ran (the"
            " process stalled past caps.lease_seconds): the fleet may briefly exceed the cap.", ["model", "backend"],
            registry=r,
        )
        self.backend_limit = Gauge(
            "llm_gateway_backend_limit", "Most requests the gateway sends to a backend at once (its cap; -1: none).",
            ["model", "backend"], registry=r,
        )
        self.lora_events = Counter(
            "llm_gateway_lora_events", "LoRA adapters loaded, unloaded (least recently used) and failed to load on"
            " each replica by this gateway (backends/lora.py).", ["model", "backend", "adapter", "event"], registry=r,
        )
        self.admission_rejected = Counter(
            "llm_gateway_admission_rejected", "Requests refused while waiting for a backend slot, by reason:"
            " queue_full, queue_timeout, past_deadline (the client's own timeout, which the openai and anthropic"
            " SDKs send, ends before a slot), cold_start_timeout, replicas_down (every replica that could serve it"
            " went down while it waited).",
            ["model", "reason"], registry=r,
        )
        self.batch_preemptions = Counter(
            "llm_gateway_batch_preemptions_total", "Batch API lines stopped to give their slot to a better class's"
            " waiting request (batch.preempt, policies/preemption.py); each runs again.", ["model"], registry=r,
        )
        # each call of a variant moves these: tallied like the calls' own (policies/tally.py)
        self.variant_requests = TallyCounter(
            "llm_gateway_variant_requests", "Requests of models with variants, by the variant that served them and"
            " HTTP status.", ("model", "variant", "status"),
        )
        self.variant_errors = TallyCounter(
            "llm_gateway_variant_errors", "Failed requests of a variant by kind: upstream_error, timeout, no_backend"
            " (held against it), at_capacity, rejected, client_closed.", ("model", "variant", "kind"),
        )
        self.variant_ttft = TallyHistogram(
            "llm_gateway_variant_time_to_first_token_seconds", "A variant's backend time to first token (queue"
            " excluded), by the load it met: requests in flight to its server when sent, up to this many.",
            ("model", "variant", "load"), LATENCY_BUCKETS,
        )
        self.variant_itl = TallyHistogram(
            "llm_gateway_variant_inter_token_latency_seconds", "A variant's mean time between output tokens per"
            " stream, by the load it met.", ("model", "variant", "load"),
            (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
        )
        self.variant_tokens_per_second = TallyHistogram(
            "llm_gateway_variant_output_tokens_per_second", "A variant's output tokens per second of each stream.",
            ("model", "variant"), (1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280),
        )
        self.variant_structured = TallyCounter(
            "llm_gateway_variant_structured_answers", "A variant's structured answers (response_format JSON, tool"
            " call arguments), by whether they were valid.", ("model", "variant", "valid"),
        )
        self.variant_length = TallyCounter(
            "llm_gateway_variant_length_finishes", "A variant's answers cut at the length limit"
            " (finish_reason=length).", ("model", "variant"),
        )
        for tally in (self.variant_requests, self.variant_errors, self.variant_ttft, self.variant_itl,
                      self.variant_tokens_per_second, self.variant_structured, self.variant_length):
            r.register(tally)
        self.variant_guard_actions = Counter(
            "llm_gateway_variant_guard_actions", "What a variant's guard did: rollback (with the signal that was"
            " worse than the baseline's), promote, or even_load (a load matching began, with the signal it could not judge otherwise).", ["model", "variant", "action", "signal"], registry=r,
        )
        self.variant_guard_undecided = Gauge(
            "llm_gateway_variant_guard_undecided_seconds", "How long a candidate's guard has been unable to judge"
            " every signal (too few samples at comparable load; the reason is in the admin view); 0 while it"
            " judges.", ["model", "variant"], registry=r,
        )
        self.variant_shadow_dropped = Counter(
            "llm_gateway_variant_shadow_dropped", "Copies for a shadow variant not sent: its cap was full, it had no"
            " replica up, or the live call failed.", ["model", "variant"], registry=r,
        )
        self.variant_weight = Gauge(
            "llm_gateway_variant_weight", "Each variant's weight now in force (file, admin API or guard).",
            ["model", "variant"], registry=r,
        )
        self.rented_cost = Counter(
            "llm_gateway_rented_cost", "Cost of rented tokens at the provider's configured price (currency units).",
            ["model", "provider"], registry=r,
        )
        self.rent_refused = Counter(
            "llm_gateway_rent_refused", "Calls that would have spilled to a rented provider but were kept on owned"
            " backends at the moment of renting, by why (data_policy: the key's current record no longer allows it).",
            ["model", "reason"], registry=r,
        )
        self.retries = Counter(
            "llm_gateway_retries", "Requests sent again to another replica before anything reached the client, by"
            " why the attempt before failed (connect, reset, timeout: no response head in time, status_5xx,"
            " status_429).", ["model", "reason"], registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "llm_gateway_retry_budget_exhausted", "Retries refused because the model's retry budget"
            " (retries.budget over retries.window) was spent: the failure went to the client.", ["model"],
            registry=r,
        )
        self.fallbacks = Counter(
            "llm_gateway_fallbacks", "Calls sent down their model's fallback chain, by the step taken (`to`: a"
            " model, or `rented:` and the provider's name) and why the step before could not serve (unavailable:"
            " no replica up or reachable; failed: its attempts failed; full: past its queue bound or a 429).",
            ["model", "to", "reason"], registry=r,
        )
        self.stream_migrations = Counter(
            "llm_gateway_stream_migrations", "Streams whose replica failed mid-body, by outcome: continued (it went"
            " on from another replica), unfaithful (it could not be continued as the same stream: n > 1, logprobs,"
            " tools...), exhausted (retries.migrations used up), failed (no other replica took it).",
            ["model", "outcome"], registry=r,
        )
        self.replica_ejections = Counter(
            "llm_gateway_replica_ejections", "Replicas taken out of routing by outlier ejection, by rule"
            " (consecutive_failures, ttft).", ["model", "backend", "rule"], registry=r,
        )
        self.egress_refused = Counter(
            "llm_gateway_egress_refused", "Connections to a backend refused because its name resolved to a public"
            " address (outside network.private_cidrs).", ["host"], registry=r,
        )
        self.observer_errors = Counter(
            "llm_gateway_observer_errors", "Finished calls an observer (metrics, access log, usage, ledger, tracing,"
            " shadow, variant signals) failed to take note of: logged, the response unharmed.", ["observer"],
            registry=r,
        )
        self.background_errors = Counter(
            "llm_gateway_background_write_errors", "Store writes made off the request path that did not happen:"
            " dropped (backlog full: lost) or failed (the store refused it: a usage batch is kept and retried, a"
            " last-used time or a rate-limit release is not; the release's lease expires).", ["reason"],
            registry=r,
        )
        self.store_unavailable = Counter(
            "llm_gateway_store_unavailable", "Request steps that could not reach the shared store (a Redis outage or"
            " failover), by step and what the gateway did instead: fail_open (served, limits counted in this"
            " process), fail_closed (503), cached (key accepted from this process's cache), refused (503).",
            ["step", "outcome"], registry=r,
        )
        self.spans_dropped = Counter(
            "llm_gateway_trace_spans_dropped", "Finished spans that never reached the tracing collector, by reason:"
            " queue_full (the export queue was full: the collector is slow or down) or export_failed (the"
            " collector could not be reached or refused the batch).", ["reason"], registry=r,
        )
        # counted in a plain dict (several per request, so no lock and no child lookup) and read at exposition
        self.routing_decisions = TallyCounter(
            "llm_gateway_routing_decisions", "Routing decisions among several candidates, per scorer: whether the"
            " scorer's favourite was picked (agreed/overruled) or what it saw (prefix-affinity: hit, miss,"
            " evicted, no_prompt, or which load guard tripped: guard_queue, guard_kv, guard_shared, load_guard;"
            " session-affinity: pinned, no_session).", ("model", "scorer", "outcome"),
        )
        r.register(self.routing_decisions)
        self.routing_plugin_time = TallyHistogram(  # one observation per plugin per pick: kept like the decisions
            "llm_gateway_routing_plugin_duration_seconds", "Time one routing plugin took for one pick, by plugin and"
            " step (filter, score, pick, learn).", ("model", "plugin", "step"), PLUGIN_BUCKETS,
        )
        r.register(self.routing_plugin_time)
        self.prefix_match_chars = Histogram(
            "llm_gateway_routing_prefix_match_chars", "Prompt characters the chosen replica was expected to hold"
            " in its prefix cache (prefix-affinity's match).", ["model"],
            buckets=(0, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=r,
        )
        self.prefix_match_ratio = Histogram(
            "llm_gateway_routing_prefix_match_ratio", "Fraction of the prompt's blocks the chosen replica was"
            " expected to hold in its prefix cache.", ["model"],
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0), registry=r,
        )
        self.scrape_errors = Counter(
            "llm_gateway_vllm_scrape_errors", "Failed scrapes of a backend's vLLM /metrics (routing then treats"
            " its stats as unknown once they are stale).", ["model", "backend"], registry=r,
        )
        self.scrape_age = Gauge(
            "llm_gateway_vllm_scrape_age_seconds", "Seconds since the last good scrape of a backend's vLLM"
            " /metrics, as of the last attempt.", ["model", "backend"], registry=r,
        )
        self.report = ReportGauges(r)  # the own-vs-rent report's figures (policies/ledger/gauges.py)
        # children looked up once (policies/memo.py): the calls below run for every request
        self.series = Memo(lambda model, backend: _Series(self, model, backend))
        self.ttft_by = Memo(lambda model: self.time_to_first_token.child((model,)))

    def call_finished(self, model: str, backend: str, status: int, elapsed: float, overhead: float, prompt: int,
                      completion: int, served_by: str | None, endpoint: str = "") -> None:
        """Everything one finished call moves, through children looked up once per (model, backend)."""
        series = self.series(model, backend)
        self.requests.add((model, backend, str(status), endpoint))
        series.duration(elapsed)
        series.overhead(overhead)
        if prompt:
            self.prompt_tokens.add(series.key, prompt)
        if completion:
            self.completion_tokens.add(series.key, completion)
        if served_by is not None:
            where = series.served[served_by]
            self.served.add(where)
            if prompt + completion:
                self.served_tokens.add(where, prompt + completion)

    def decision(self, model: str, scorer: str, outcome: str) -> None:
        self.routing_decisions.add((model, scorer, outcome))

    def plugin_timer(self, model: str, plugin: str, step: str) -> Callable[[float], None]:
        """Observes one plugin's seconds for one step of a pick (a routing profile asks once per plugin)."""
        return self.routing_plugin_time.child((model, plugin, step))

    def prefix_match(self, model: str, chars: int, ratio: float) -> None:
        self.prefix_match_chars.labels(model).observe(chars)
        self.prefix_match_ratio.labels(model).observe(ratio)

    def scraped(self, model: str, backend: str, age: float | None, failed: bool) -> None:
        if failed:
            self.scrape_errors.labels(model, backend).inc()
        if age is not None:
            self.scrape_age.labels(model, backend).set(age)

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft_by(model)(seconds)

    def observe(self, record: Finished) -> None:
        """One finished call: its request, duration, overhead and tokens; its cost when rented."""
        model = record.model or "unknown"
        backend = record.replica.name if record.replica is not None else "none"
        if not record.model:
            self.call_refused(model, backend, record.status, record.endpoint)
            return
        if record.served_by == RENTED:
            self.rented_cost.labels(model, record.rented).inc(record.cost)
        self.call_finished(model, backend, record.status, record.elapsed, record.overhead, record.prompt_tokens,
                           record.completion_tokens, record.served_by, record.endpoint)

    def observer_failed(self, name: str) -> None:
        self.observer_errors.labels(name).inc()

    def call_refused(self, model: str, backend: str, status: int, endpoint: str = "") -> None:
        """A call that never got as far as a model (bad body, unknown key)."""
        self.requests.add((model, backend, str(status), endpoint))


class _Series:
    """The children one finished call of a (model, backend) moves, fetched together."""

    __slots__ = ("duration", "key", "overhead", "served")

    def __init__(self, m: GatewayMetrics, model: str, backend: str) -> None:
        self.duration = m.request_duration.child((model,))
        self.overhead = m.overhead.child((model,))
        self.key = (model, backend)  # of the token tallies
        self.served = {where: (model, where) for where in ("owned", "rented")}
