"""Every policy setting is either applied by a hot reload or refused by it, naming the setting: none is
accepted and silently ignored. This walks the policy schema, so a new setting must be classified here."""

from __future__ import annotations

from pydantic import BaseModel

from policies.config import Policy
from policies.snapshot import NEEDS_RESTART

# Applied on reload: each is rebuilt into the next snapshot, or carried over and updated by it.
LIVE = {
    "routing.default_profile", "routing.profiles", "rate_limits.default_max_tokens", "priorities", "network",
    "providers", "access_log", "models", "console",
    # read from the live policy by each Batch API operation and each round of its runner (policies/batches/)
    "batch.max_file_bytes", "batch.max_lines", "batch.max_line_bytes", "batch.max_queued_lines_per_key",
    "batch.concurrency", "batch.max_in_flight", "batch.priority_class", "batch.allow_rented", "batch.claim_seconds",
    "batch.poll_seconds", "batch.completion_window_seconds", "batch.max_bytes_per_key", "batch.max_files_per_key",
    "batch.file_retention_seconds", "batch.output_retention_seconds", "batch.sweep_seconds",
    "batch.preempt", "batch.max_preemptions",  # read by the runner for each run of a line
}
# Grouped settings whose sub-settings are classified one by one (in LIVE or NEEDS_RESTART).
SPLIT = {"routing", "rate_limits", "batch"}

HOW = ("policy setting {path!r} is not classified for hot reload. If a reload applies it (check that the "
       "snapshot in policies/snapshot.py rebuilds or updates what reads it, and test it in "
       "tests/integration/test_policy_reload.py), add {path!r} to LIVE in tests/unit/test_reload_classes.py; if "
       "it is read once at start, add {path!r} to NEEDS_RESTART in policies/snapshot.py, so a reload that "
       "changes it is refused with its name.")


def settings(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path = prefix + name
        if path in SPLIT:
            paths += settings(field.annotation, path + ".")
        else:
            paths.append(path)
    return paths


def test_every_policy_setting_is_live_or_restart_only():
    restart = set(NEEDS_RESTART)
    assert not LIVE & restart, LIVE & restart
    walked = settings(Policy)
    for path in walked:
        assert path in LIVE or path in restart, HOW.format(path=path)
    stale = (LIVE | restart) - set(walked)
    assert not stale, f"classified settings the policy no longer has: {sorted(stale)}; remove them"
