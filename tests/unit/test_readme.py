"""The README stays a front page: short, its first policy a valid one, its links to pages that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_first_policy_in_the_readme_passes_check(tmp_path):
    block = re.search(r"^```yaml\n(.*?)^```", README, flags=re.S | re.M)
    assert block, "the README shows no policy file"
    policy = tmp_path / "policy.yaml"
    policy.write_text(block.group(1), encoding="utf-8")
    # the command the README tells readers to run, in a process of its own (egress rules included: the
    # backend's address is an IP literal, so nothing is resolved)
    done = subprocess.run([sys.executable, "-m", "gateway", "check", str(policy)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok (1 models, 1 backends)" in done.stdout


def test_readme_is_short_and_links_only_to_files_that_exist():
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert "docs/getting-started.md" in local and "docs/reference/policy.md" in local
    missing = [link for link in local if not (ROOT / link).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_names_the_ten_slowest_tests_and_each_still_exists():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import slowest_tests
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    named = slowest_tests.named(README)
    assert len(named) == slowest_tests.COUNT, named
    gone = [nodeid for nodeid in named if not slowest_tests.exists(nodeid)]
    assert not gone, f"the README's slowest tests name tests that no longer exist: {gone} (scripts/slowest_tests.py)"
