"""Prometheus metrics named, typed and labelled like vLLM 0.32's vllm:* families.

Each simulator owns its CollectorRegistry, so several can run in one process (the demo does) without their
series colliding. Only the families the simulator can honestly fill are exposed; bucket edges are vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .config import SimConfig

ENGINE = "0"
FINISHED_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class SimMetrics:
    """The engine reports into this; /metrics renders `registry`."""

    def __init__(self, cfg: SimConfig, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, names, values = self.registry, ("engine", "model_name"), (ENGINE, cfg.model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ("engine", "finished_reason", "model_name"), registry=reg)
        self._success = {reason: success.labels(ENGINE, reason, cfg.model) for reason in FINISHED_REASONS}
        # vLLM's cache_config_info carries engine but no model_name label.
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "kv_cache_size_tokens",
               "num_gpu_blocks"), registry=reg).labels(
            str(cfg.block_size), "auto", str(cfg.enable_prefix_caching), ENGINE, str(cfg.kv_cache_tokens),
            str(cfg.kv_cache_tokens // cfg.block_size)).set(1)

    def bind_gauges(self, running: Callable[[], float], waiting: Callable[[], float],
                    kv_usage: Callable[[], float]) -> None:
        """Gauges read the engine's live state at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def finished(self, reason: str) -> None:
        self._success[reason].inc()
