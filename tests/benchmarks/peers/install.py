"""Install what the peer benchmark needs, once, into `.cache/bench/` (and Debian's nginx and wrk).

Idempotent: each venv carries a stamp naming what was installed into it; a second run checks the stamps and the
binaries and does nothing. Output is kept quiet; a failure prints the tail of what the installer said.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".cache" / "bench"

# Peers: each in its own venv, so their dependencies never meet the gateway's. `ceilings` holds the minimal
# apps of ceiling_apps.py, with the gateway's own versions of the server and client stack (read from the venv
# running this), plus the alternatives measured against them.
SAME_AS_GATEWAY = ["uvicorn", "httptools", "uvloop", "httpx", "httpcore", "anyio", "sniffio", "orjson"]


def venvs() -> dict[str, list[str]]:
    from importlib.metadata import PackageNotFoundError, version

    pinned = []
    for dist in SAME_AS_GATEWAY:
        try:
            pinned.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            pinned.append(dist)
    return {
        "litellm": ["litellm[proxy]"],
        "router": ["vllm-router"],
        "tools": ["py-spy"],
        "ceilings": [*pinned, "aiohttp", "granian"],
    }


APT = {"nginx": "/usr/sbin/nginx", "wrk": "/usr/bin/wrk"}
PIP_NOISE = "is ignored: it is neither a file nor a directory"


@dataclass
class Installed:
    seconds: float
    did: list[str]


def _run(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"install: {what} took longer than {timeout:.0f} s") from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if PIP_NOISE not in ln]
        tail = "\n".join(lines[-30:])
        raise SystemExit(f"install: {what} failed (exit {proc.returncode}):\n{tail}")


def venv_python(name: str) -> Path:
    return CACHE / f"{name}-venv" / "bin" / "python"


def ensure_venv(name: str, requirements: list[str]) -> bool:
    venv = CACHE / f"{name}-venv"
    stamp = venv / ".bench-installed"
    wanted = "\n".join(requirements)
    if stamp.exists() and stamp.read_text() == wanted and venv_python(name).exists():
        return False
    if not venv_python(name).exists():
        _run([sys.executable, "-m", "venv", str(venv)], f"venv {name}", 120)
    py = str(venv_python(name))
    _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
         f"pip install {' '.join(requirements)}", 900)
    stamp.write_text(wanted)
    return True


def ensure_apt(packages: dict[str, str]) -> list[str]:
    missing = [name for name, binary in packages.items() if not Path(binary).exists()]
    if not missing:
        return []
    if shutil.which("apt-get") is None:
        raise SystemExit(f"install: {', '.join(missing)} missing and no apt-get here")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], "apt-get update", 300, env)
    _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
         f"apt-get install {' '.join(missing)}", 600, env)
    return missing


def ensure_all() -> Installed:
    start = time.perf_counter()
    CACHE.mkdir(parents=True, exist_ok=True)
    did = [f"apt:{name}" for name in ensure_apt(APT)]
    for name, requirements in venvs().items():
        if ensure_venv(name, requirements):
            did.append(f"venv:{name}")
    return Installed(time.perf_counter() - start, did)


if __name__ == "__main__":
    if sys.argv[1:] == ["router"]:  # vLLM's router alone, for the routing benchmark (make bench-routing)
        done = ensure_venv("router", venvs()["router"])
        print(f"vllm-router: {'installed' if done else 'already there'} in {CACHE / 'router-venv'}")
        sys.exit(0)
    result = ensure_all()
    print(f"installed {', '.join(result.did) or 'nothing new'} in {result.seconds:.1f} s")
