"""Secrets the policy file names but never holds: read from an environment variable or a mounted file."""

from __future__ import annotations

from pathlib import Path

from policies.config.base import PolicyError


def secret(field: str, env: str | None, file: str | None) -> str | None:
    """A password from the env var `env` or the file `file` (a mounted Secret; one trailing newline dropped).
    Named but missing or empty is an error that names the variable or file, never a silent try without it."""
    if env:
        import os

        value = os.environ.get(env)
        if not value:
            raise PolicyError(f"{field}_env: the environment variable {env} is not set")
        return value
    if file:
        try:
            value = Path(file).read_text().removesuffix("\n")
        except OSError as exc:
            raise PolicyError(f"{field}_file: cannot read {file} ({type(exc).__name__})") from None
        if not value:
            raise PolicyError(f"{field}_file: {file} is empty")
        return value
    return None
