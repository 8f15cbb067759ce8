"""Rate limits per key and per model: requests/min, tokens/min and requests in flight (see base.py)."""

from policies.ratelimit.base import Decision, Limiter, Scope, Ticket, format_reset
from policies.ratelimit.memory import MemoryLimiter

__all__ = ["Decision", "Limiter", "MemoryLimiter", "Scope", "Ticket", "format_reset"]
