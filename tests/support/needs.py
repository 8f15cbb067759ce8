"""What a test needs beyond the project's venv (Redis, the OpenID provider, Chromium, helm, podman, a CPU vLLM),
and what happens when this machine lacks it.

A bare `pytest` runs every test that needs nothing installed and skips the rest, each with the `make` target that
installs what it lacks; the run ends with a count of those (tests/conftest.py). `make test` sets
GATEWAY_TESTS_ALL=1 after installing everything: there a missing part fails the test, since a skipped test is not
a passing one.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

STRICT = "GATEWAY_TESTS_ALL"
PREFIX = "needs "  # every skip reason written here starts so; tests/conftest.py counts them by it


def missing(what: str, setup: str) -> NoReturn:
    """Skip (a bare run) or fail (`make test`) the test that needs `what`; `setup` is the make target that installs it."""
    message = f"{PREFIX}{what}, which this machine lacks: `make {setup}` installs it"
    if os.environ.get(STRICT) == "1":
        pytest.fail(f"{message} (`make test` should have)")
    pytest.skip(message)
