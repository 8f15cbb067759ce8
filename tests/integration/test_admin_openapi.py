"""The OpenAPI document at /schema tells the truth: schemathesis, every check, against a real gateway.

Schemathesis generates requests from the document (valid ones, and ones the document forbids), sends them
with an admin token and checks each answer against what the document promises: status codes, content types
and bodies, 405s with an Allow header, schema-valid bodies accepted and invalid ones refused, no 5xx. The run
is bounded (examples per operation, a fixed seed), so it takes seconds and finds the same cases each time.
"""

import asyncio
import os
import re
import sys
import time
from pathlib import Path

import httpx

from gateway.admin.auth import mint_token
from policies.config import Admin
from tests.support.gateway import running_gateway
from tests.support.recorder import Recorder
from tests.support.servers import serve_app

SECRET = "s" * 40
EXAMPLES = 50  # per operation and phase: ~1000 cases, ~15 s on two cores
SEED = 20260101
# The token reaches schemathesis through its config file and the environment, never its command line.
CONFIG = 'headers = { Authorization = "Bearer ${LLMGW_TEST_ADMIN_TOKEN}" }\n[parameters]\n"path.model" = "v"\n'
ISSUED_KEY = re.compile(r"sk-[0-9a-f]{16}-[A-Za-z0-9]{43}")


def schemathesis_cli() -> str:
    return str(Path(sys.executable).with_name("schemathesis"))


async def test_schemathesis_finds_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_GATEWAY_ADMIN_SECRET", SECRET)
    token = mint_token(Admin(), 600)
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    async with serve_app(Recorder()) as up, running_gateway(
        {"models": [{"name": "m", "backends": [{"url": up}]},  # and one with variants for their routes
                    {"name": "v", "variants": [{"name": "a", "weight": 1, "backends": [{"url": up}]}]}]},
        issue_test_key=False
    ) as gw:
        async with httpx.AsyncClient() as client:  # /ready says "degraded" until the backend's first health check
            deadline = time.monotonic() + 10
            while (await client.get(f"{gw.url}/ready")).json()["status"] != "ready":
                assert time.monotonic() < deadline, "the backend never became healthy"
                await asyncio.sleep(0.05)
        proc = await asyncio.create_subprocess_exec(
            schemathesis_cli(), "--config-file", str(config), "--no-color",
            "run", f"{gw.url}/schema/openapi.json",
            "--checks", "all",
            "--max-examples", str(EXAMPLES),
            "--seed", str(SEED),
            "--workers", "1",
            "--generation-database", "none",
            "--request-timeout", "10",
            cwd=tmp_path,
            env={**os.environ, "LLMGW_TEST_ADMIN_TOKEN": token},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    # Failure reports quote responses, and a key-issuing response holds a secret: never print one.
    report = ISSUED_KEY.sub("sk-[redacted]", out.decode("utf-8", "replace")).replace(token, "[admin token]")
    assert proc.returncode == 0, report[-12000:]
    assert "No issues found" in report, report[-12000:]
