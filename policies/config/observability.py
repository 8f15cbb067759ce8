"""What the gateway reports: the usage and cost ledger, traces, and the access log's format."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from policies.config.base import NAME, EnvName, PolicyError, Seconds, Strict, http_url


class Ledger(Strict):
    """The usage and cost ledger over time, behind `llm-gateway report` (policies/ledger/)."""

    enabled: bool = True
    bucket_seconds: int = Field(60, ge=1, le=3600)  # one row per model, backend and key per bucket
    retention_days: float = Field(35.0, gt=0, le=3660)  # older buckets are deleted
    flush_seconds: float = Field(1.0, ge=0.05, le=60)  # how often the summed figures are written
    power_price_per_kwh: float | None = Field(None, ge=0, le=100)  # needed by any backend with cost.power_kw
    report_window_seconds: float = Field(3600.0, ge=60, le=90 * 86400)  # the window of the Prometheus gauges
    report_every_seconds: float = Field(60.0, ge=1, le=3600)  # how often those gauges are recomputed


class Tracing(Strict):
    """OpenTelemetry traces of every call, sent over OTLP/HTTP to the team's own collector (gateway/tracing/__init__.py).

    Off by default. Header values (a collector's token) come from environment variables, never from this file,
    and are never logged. A client's `traceparent` is continued and passed to owned backends whether or not this
    is on (to a rented provider only with its `send_trace_context`).
    """

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # the collector's OTLP/HTTP traces URL, path included
    headers_from_env: dict[str, EnvName] = {}  # header name -> the env var holding its value
    sampling_ratio: float = Field(1.0, ge=0, le=1)  # of traces the gateway starts; a client's traceparent decides
    service_name: str = Field("llm-gateway", min_length=1, max_length=128)
    max_queue_size: int = Field(8192, ge=1, le=1_000_000)  # finished calls whose spans wait for export; more
    # are dropped (and counted)
    # calls' spans in one export request (~1 KB each); larger batches spread the export's fixed cost thinner
    max_export_batch_size: int = Field(2048, ge=1, le=100_000)
    schedule_delay: Seconds = 1.0  # seconds between exports of a partial batch
    export_timeout: Seconds = 5.0  # one export to the collector, retries included
    content_models: list[Annotated[str, Field(pattern=NAME)]] = []  # models whose prompt and completion text
    # go into their spans (off for every model unless named here: text may be personal or confidential)

    @field_validator("endpoint")
    @classmethod
    def valid_endpoint(cls, url: str) -> str:
        return http_url(url)

    @model_validator(mode="after")
    def batch_fits_queue(self) -> Tracing:
        if self.max_export_batch_size > self.max_queue_size:
            raise ValueError("max_export_batch_size must not exceed max_queue_size")
        return self

    def headers(self) -> dict[str, str]:
        """The export headers from their environment variables; a missing one is an error naming the variable
        (never the value)."""
        import os

        values = {}
        for header, env in self.headers_from_env.items():
            value = os.environ.get(env)
            if not value:
                raise PolicyError(f"tracing.headers_from_env.{header}: the environment variable {env} is not set")
            values[header] = value
        return values


class AccessLogSettings(Strict):
    format: Literal["text", "json"] = "text"  # json: one JSON object a line, with the trace id, for log pipelines
