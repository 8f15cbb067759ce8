"""`admin.audit`: how long the audit log of admin acts is kept (policies/audit/)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AuditSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    retention_days: float = Field(365.0, gt=0, le=10 * 365, description="events older than this are deleted")
    max_events: int = Field(1_000_000, ge=100, le=100_000_000, description="only the newest this many are kept")
