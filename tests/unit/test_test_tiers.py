"""The test tiers: a bare `pytest` skips what needs a part the machine lacks and says which `make` target installs
it; `make test` (GATEWAY_TESTS_ALL=1) fails the same test instead, so nothing it should run is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NEEDY = '''
from tests.support.needs import missing

def test_needs_a_part():
    missing("a frobnicator", "frob-setup")

def test_needs_nothing():
    assert True
'''


def run_pytest(tmp_path: Path, strict: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_needy.py").write_text(NEEDY)
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_TESTS_ALL"}
    env["PYTHONPATH"] = str(REPO)
    if strict:
        env["GATEWAY_TESTS_ALL"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_needy.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_bare_run_skips_what_needs_a_missing_part_and_names_the_make_target(tmp_path):
    done = run_pytest(tmp_path, strict=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout
    assert "held back: parts this machine lacks" in done.stdout
    assert "1 tests needs a frobnicator, which this machine lacks: `make frob-setup` installs it" in done.stdout
    assert (tmp_path / "build" / "durations.txt").read_text().count("test_needy.py::") == 2


def test_make_test_fails_what_a_bare_run_would_skip(tmp_path):
    done = run_pytest(tmp_path, strict=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout
    assert "needs a frobnicator" in done.stdout and "held back" not in done.stdout
