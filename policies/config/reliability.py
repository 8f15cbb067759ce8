"""What a model does when a replica fails it: retries before the first byte, streams that go on from another
replica when theirs fails mid-body, and outlier ejection."""

from __future__ import annotations

from pydantic import Field, model_validator

from policies.config.base import Seconds, Strict


class Retries(Strict):
    """Retries of a request on another replica, before anything was sent to the client: after a connect
    failure, a reset, a 5xx, a 429, or no response head within `timeouts.read`. Never the same replica twice,
    and within a budget: over a sliding `window`, retries add at most `budget` times the model's request rate
    (plus `min_retries`), so a model whose replicas all fail is not sent more than ~1.2x its traffic. A stream
    whose replica fails after its first byte goes on from another replica up to `migrations` times."""

    attempts: int = Field(2, ge=0, le=10)  # retries per request after the first attempt; 0: never retry
    budget: float = Field(0.2, ge=0, le=10)  # retries as a share of the model's requests over the window
    window: Seconds = 10.0  # the sliding window the budget counts over
    min_retries: int = Field(3, ge=0, le=10_000)  # retries the budget allows per window whatever the rate
    # times a Chat Completions or Completions stream whose replica fails mid-body goes on from another replica
    # with the text generated so far (gateway/migration.py); 0: never, the stream ends with an error event.
    # Not counted against the budget: each follows a failure the client would otherwise see
    migrations: int = Field(1, ge=0, le=5)


class Ejection(Strict):
    """Outlier ejection: a replica that keeps failing (`consecutive_failures` 5xx or timeouts in a row) or whose
    time to first token is far above its peers' (`ttft_ratio` times their median, once it and a peer have
    `ttft_min_samples` streams) is taken out of routing for `base_seconds`, doubling with each ejection up to
    `max_seconds`; the backoff starts again once it has served well for as long as its last ejection lasted.
    Never more than `max_ejected_share` of a model's replicas at once, and never its last one."""

    enabled: bool = True  # false: no replica of this model is ever ejected
    consecutive_failures: int = Field(5, ge=1, le=1000)  # 5xx answers or timeouts in a row that eject a replica
    # a replica whose time to first token is this many times its peers' median is ejected; null: never by TTFT
    ttft_ratio: float | None = Field(3.0, gt=1, le=1000)
    # streams a replica and at least one peer must have had before their TTFTs are compared (also the span of
    # the moving average)
    ttft_min_samples: int = Field(20, ge=1, le=100_000)
    base_seconds: Seconds = 5.0  # the first ejection's length; each one in a row doubles it
    max_seconds: Seconds = 300.0  # the longest ejection
    # the most of a model's replicas (of each variant's) out at once, rounded down; the last one always stays
    max_ejected_share: float = Field(0.5, ge=0, le=1)

    @model_validator(mode="after")
    def ordered(self) -> Ejection:
        if self.max_seconds < self.base_seconds:
            raise ValueError("ejection.max_seconds must be at least ejection.base_seconds")
        return self
