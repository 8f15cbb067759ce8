"""Tools beside the gateway, not part of its runtime: the vLLM simulator (tools/simulator: the demo's and the
tests' backends, and load shapes a CPU vLLM cannot produce) and the knee measurement of a backend (tools/knee:
`llm-gateway knee`). They import nothing of the gateway; the gateway's request path, the policies and the backends
never import them (pyproject.toml's import contracts): only the CLI's `demo` and `knee` commands do."""
