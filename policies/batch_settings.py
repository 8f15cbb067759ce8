"""The Batch API's settings (`batch:` in the policy file): where uploaded files live, how large they may be, and
how the background runner spends owned capacity. See the README's "The Batch API" section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024


class BatchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # serve /v1/files and /v1/batches and run batches in the background
    # where uploaded and output files are kept (a volume: the chart mounts a PVC there); metadata is in the store
    files_dir: str = "batch-files"
    max_file_bytes: int = Field(100 * MiB, ge=1024, le=2048 * MiB)  # an upload past it is a 413 (OpenAI: 200 MB)
    max_lines: int = Field(50_000, ge=1, le=1_000_000)  # lines in one batch input file (OpenAI's own limit)
    max_line_bytes: int = Field(1 * MiB, ge=256, le=64 * MiB)  # one request line
    # lines not yet answered across a key's open batches; a new batch past it is refused (400), so one key cannot
    # queue days of work in front of the others' batches
    max_queued_lines_per_key: int = Field(100_000, ge=1)
    concurrency: int = Field(8, ge=1, le=1024)  # lines of one batch in flight from one gateway process at once
    # lines of all batches in flight from one gateway process; keep it (times the gateway replicas) below the
    # backends' caps minus the interactive peak, so an interactive call finds a free slot rather than waiting
    # for a batch line to end (docs/benchmarks.md: the batch fill benchmark)
    max_in_flight: int = Field(16, ge=1, le=4096)
    priority_class: str = "batch"  # the class lines are admitted in (the last class when the policy has no such one)
    # lines may spill to a model's rented provider (for a key whose data policy allows it); off by default: batch
    # work exists to fill owned GPUs' idle time, and renting it costs full price for work that can wait
    allow_rented: bool = False
    claim_seconds: float = Field(60.0, gt=0, le=3600)  # a claimed line comes back to the queue if not renewed within
    poll_seconds: float = Field(1.0, gt=0, le=60)  # how often an idle runner looks for work
    completion_window_seconds: float = Field(86400.0, gt=0)  # "24h": a batch not done by then ends `expired`
