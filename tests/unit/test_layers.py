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
    for package in ("gateway", "policies", "backends"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_its_layers(tmp_path):
    result = lint(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    module = root / "backends" / "replicas.py"
    module.write_text(module.read_text() + "\nfrom policies.config import Policy  # noqa: E402 - deliberately upward\n")
    result = lint(root)
    assert result.returncode != 0
    assert "backends.replicas -> policies.config" in result.stdout
