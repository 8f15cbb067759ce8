"""The reference pages of the docs site are the code's own: regenerated, they equal what is committed.

docs/reference/{policy,metrics,cli,admin-api}.md are written by `python -m gateway.reference_docs` from the
policy schema, the metrics registry, the CLI's parsers and the app's OpenAPI document. A field, metric, option
or admin route added without `make reference` leaves a page behind, and this test names it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gateway.reference_docs import PAGES
from policies.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "reference"


def generate(into: Path) -> float:
    started = time.monotonic()
    # run where it writes, so that a stray file (a store opened in the working directory) would show
    done = subprocess.run([sys.executable, "-m", "gateway.reference_docs", str(into)], cwd=into,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.monotonic() - started


def test_committed_reference_pages_equal_what_the_code_generates(tmp_path):
    took = generate(tmp_path)
    stale = [name for name in PAGES
             if not (COMMITTED / name).exists()
             or (COMMITTED / name).read_text(encoding="utf-8") != (tmp_path / name).read_text(encoding="utf-8")]
    assert not stale, f"docs/reference/{{{','.join(stale)}}} differ from the code: run `make reference`"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PAGES)  # nothing left beside the pages
    assert took < 60  # about 3 s; generous for a loaded machine


def test_metrics_page_names_every_series_the_registry_exports():
    page = (COMMITTED / "metrics.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", page, flags=re.M))
    exported = set()
    for family in GatewayMetrics().registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    assert exported and exported == listed


def test_cli_page_has_every_command_the_cli_offers():
    helped = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0, helped.stderr[-2000:]
    commands = set(re.search(r"\{([a-z,-]+)\}", helped.stdout).group(1).split(","))
    page = (COMMITTED / "cli.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^### llm-gateway ([a-z-]+)$", page, flags=re.M))
    assert {"serve", "check", "keys", "knee"} <= commands
    assert commands == sections
