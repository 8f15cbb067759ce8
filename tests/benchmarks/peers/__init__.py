"""Gateway overhead against peers (LiteLLM proxy, vllm-router, nginx): `python -m tests.benchmarks.peers.run`."""
