"""The Batch API's settings (`batch:` in the policy file): where uploaded files live, how large they may be, and
how the background runner spends owned capacity. See the README's "The Batch API" section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024
GiB = 1024 * MiB
DAY = 86400


class BatchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # serve /v1/files and /v1/batches and run batches in the background
    # where uploaded and output files are kept (a volume: the chart mounts a PVC there); metadata is in the store
    files_dir: str = "batch-files"
    max_file_bytes: int = Field(100 * MiB, ge=1024, le=2048 * MiB)  # an upload past it is a 413 (OpenAI: 200 MB)
    max_lines: int = Field(50_000, ge=1, le=1_000_000)  # lines in one batch input file (OpenAI's own limit)
    max_line_bytes: int = Field(1 * MiB, ge=256, le=64 * MiB)  # one request line
    # what one key's files (uploads and batch outputs) may hold on the shared volume, so one key cannot fill it and
    # take every other key's batches down: 2 GiB is 20 uploads of max_file_bytes, a tenth of the chart's 20Gi
    # volume; an upload past it is a 400 `storage_limit_reached`. Outputs are written even past it (results are
    # never lost); the key's next uploads are refused until its files expire or it deletes some
    max_bytes_per_key: int = Field(2 * GiB, ge=1 * MiB)
    # files one key may have: bounds its listing (all of a key's files fit one page of /v1/files) and the store
    max_files_per_key: int = Field(10_000, ge=1, le=100_000)
    # how long an upload without `expires_after` is kept (OpenAI keeps batch files 30 days by default); an upload's
    # own `expires_after` may say 1 hour to 30 days, as OpenAI's does
    file_retention_seconds: int = Field(30 * DAY, ge=3600)
    output_retention_seconds: int = Field(30 * DAY, ge=3600)  # a batch's output and error files (OpenAI: 30 days)
    # how often each gateway process deletes expired files (up to 200 a sweep; an input of a batch not yet ended is
    # kept until it ends); an expired file answers 404 at once, the sweep only frees its space
    sweep_seconds: float = Field(60.0, gt=0, le=3600)
    # lines not yet answered across a key's open batches; a new batch past it is refused (400), so one key cannot
    # queue days of work in front of the others' batches
    max_queued_lines_per_key: int = Field(100_000, ge=1)
    concurrency: int = Field(8, ge=1, le=1024)  # lines of one batch in flight from one gateway process at once
    # lines of all batches in flight from one gateway process; keep it (times the gateway replicas) below the
    # backends' caps minus the interactive peak, so an interactive call finds a free slot rather than waiting
    # for a batch line to end (docs/benchmarks.md: the batch fill benchmark)
    max_in_flight: int = Field(16, ge=1, le=4096)
    priority_class: str = "batch"  # the class lines are admitted in (the last class when the policy has no such one)
    # a line holding a slot gives it back the moment a better class's request must wait for one: its call is stopped
    # (vLLM keeps its prompt cached) and it runs again, so interactive work never waits for a line to end; off: a
    # line holds its slot to its end, and only queue.reserve keeps slots free (policies/preemption.py)
    preempt: bool = True
    # times a line may be preempted; its next run goes to its end, so no line is put off for ever (counted while one
    # process holds the line's claim)
    max_preemptions: int = Field(3, ge=0, le=100)
    # lines may spill to a model's rented provider (for a key whose data policy allows it); off by default: batch
    # work exists to fill owned GPUs' idle time, and renting it costs full price for work that can wait
    allow_rented: bool = False
    claim_seconds: float = Field(60.0, gt=0, le=3600)  # a claimed line comes back to the queue if not renewed within
    poll_seconds: float = Field(1.0, gt=0, le=60)  # how often an idle runner looks for work
    completion_window_seconds: float = Field(86400.0, gt=0)  # "24h": a batch not done by then ends `expired`
