"""A stand-in for one single-model vLLM server: same API shapes, errors and metrics, simulated latency.

Used for the demo and for load shapes a CPU vLLM cannot produce. It imitates vLLM's interface and its
continuous-batching latency curve; it does not run a model, and it refuses what it cannot honestly do
(n > 1, logprobs, tool calls, batched prompts).
"""

from .app import create_app
from .config import SimConfig

__all__ = ["SimConfig", "create_app"]
