"""The gateway's own weight changes in the audit log, beside the admins': the variant guard's (a rollback, a
promotion step) and weights adopted from another gateway replica.

Admins' changes are recorded where they are made (gateway/admin/variants.py); these have no token behind
them, so they are recorded as the system. They arrive through Variants' `on_change` observers, as the shared
state (policies/variant_share.py) hears them. (A refused policy reload is recorded by gateway/reload.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from gateway.admin.audit import AdminAudit
from policies.variant_guard import GUARD
from policies.variant_share import SHARED


class SystemAudit:
    """Records the gateway's own weight changes as the system; `run` starts a coroutine in the background."""

    def __init__(self, audit: AdminAudit, run: Callable[[Coroutine[Any, Any, None]], Any]) -> None:
        self.audit = audit
        self.run = run

    def weights_changed(self, model: str, before: dict[str, float], after: dict[str, float], why: str) -> None:
        """A Variants observer: the guard's and other replicas' weight changes (an admin's is its route's)."""
        if why.startswith((GUARD, SHARED)):
            self.run(self.audit.system("variants.weights", model, {"why": why, "from": before, "to": after}))
