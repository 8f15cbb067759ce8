"""The layers contract (pyproject's [tool.importlinter]) holds for the tree, and breaks on an upward import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def copy_tree(tmp_path: Path) -> Path:
    for package in ("gateway", "policies", "backends", "tools"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_its_layers(tmp_path):
    result = lint(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kept, 0 broken" in result.stdout


def lint_with(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess:
    """Lint a copy of the tree in which `module` (a path under it) ends with `line`."""
    root = copy_tree(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return lint(root)


def test_an_upward_import_breaks_the_contract(tmp_path):
    result = lint_with(tmp_path, "backends/replicas.py",
                       "from policies.config import Policy  # noqa: E402 - deliberately upward")
    assert result.returncode != 0
    assert "backends.replicas -> policies.config" in result.stdout


def test_the_runtime_importing_a_tool_breaks_the_contract(tmp_path):
    """The simulator and the knee tool (tools/) are for the CLI's demo and knee commands; the request path never
    imports them, even where the layers alone would allow it (gateway/ is above tools/)."""
    result = lint_with(tmp_path, "gateway/proxy.py", "import tools.simulator  # noqa: E402 - deliberately forbidden")
    assert result.returncode != 0
    assert "gateway.proxy -> tools.simulator" in result.stdout
