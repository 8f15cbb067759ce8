"""The policy's `console:` section: the admin console served by the gateway under /console (gateway/console/).

Off by default: a gateway exposes no HTML unless the policy asks for it. Read on every request, so a reload
turns it on or off without a restart.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Console(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = False
    secure_cookie: bool = Field(True, description="send the session cookie over HTTPS only; turn off only for a"
                                " console reached over plain HTTP on a trusted network (or loopback)")
    session_seconds: int = Field(8 * 3600, ge=60, le=7 * 86400, description="longest a console session lasts;"
                                 " never past the admin token's own expiry")
    page_size: int = Field(50, ge=10, le=500, description="keys per page of the keys list")
    refresh_seconds: float = Field(2.0, ge=0.5, le=60, description="how often the fleet page refreshes")
