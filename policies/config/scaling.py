"""The replica-count signal an autoscaler reads, and scale from zero."""

from __future__ import annotations

from pydantic import Field

from policies.config.base import Seconds, Strict


class Autoscaling(Strict):
    """The replicas a model needs at its knee, for an autoscaler to read (policies/scaling.py), and what its
    requests do while it has none (scale from zero). See the README's "Autoscaling" section."""

    # extra replicas asked for beyond the demand, as a fraction of it: a new replica takes minutes to start,
    # so the signal asks for one before the queue forms rather than once it has
    headroom: float = Field(0.1, ge=0, le=10)
    # a fall in demand is followed with this time constant (a rise at once): a lull between bursts does not
    # scale a replica away only to start it again; 0 follows the demand as it is
    smoothing_seconds: float = Field(60.0, ge=0, le=3600)
    # while no replica of the model can serve (all scaled away, or starting), requests wait this long for one
    # in the queue (within queue.max_depth); past it: 503 with Retry-After. About one vLLM cold start.
    cold_start_wait: Seconds = 300.0
    # the cap of one replica the signal divides by; default: discovery.cap, else the mean of the backends' caps
    replica_cap: int | None = Field(None, ge=1, le=100_000)
    # batch-class demand (batch lines, in flight and queued) raises the replica count too; off by default: batch
    # work fills the idle capacity of the replicas there are and can wait, so it is its own gauge
    # (llm_gateway_batch_demand) rather than a reason to start a replica
    count_batches: bool = False
