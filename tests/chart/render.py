"""Rendering the chart with the helm binary scripts/setup_helm.sh installs (`make test` runs it first)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support.needs import missing

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llm-gateway"
VALUES = Path(__file__).parent / "values"
HELM = ROOT / ".cache" / "bin" / "helm"
NAMESPACE = "llm"


class RenderError(Exception):
    pass


def helm(*args: str, chart: Path = CHART) -> str:
    if not HELM.exists():
        missing(f"helm ({HELM})", "helm-setup")
    proc = subprocess.run([str(HELM), *args, str(chart)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    return proc.stdout


def render(*values_files: str, sets: dict[str, str] | None = None, chart: Path = CHART) -> list[dict]:
    """`helm template` -> the manifests, as dicts (empty documents dropped)."""
    args = ["template", "rel", "--namespace", NAMESPACE]
    for name in values_files:
        args += ["-f", str(VALUES / name) if not Path(name).is_absolute() else name]
    for key, value in (sets or {}).items():
        args += ["--set-string" if isinstance(value, str) else "--set", f"{key}={value}"]
    return [doc for doc in yaml.safe_load_all(helm(*args, chart=chart)) if doc]


def render_notes(tmp_path: Path, *values_files: str, sets: dict[str, str] | None = None) -> str:
    """NOTES.txt as `helm install` would print it: `helm template` leaves it out, so a copy of the chart
    renders it into a ConfigMap."""
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    (copy / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ include "llm-gateway/templates/NOTES.txt" . | quote }}\n'
    )
    docs = render(*values_files, sets=sets, chart=copy)
    return next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "notes")["data"]["notes"]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def policy_of(docs: list[dict]) -> dict:
    (cm,) = find(docs, "ConfigMap", "rel-llm-gateway-policy")
    return yaml.safe_load(cm["data"]["policy.yaml"])
