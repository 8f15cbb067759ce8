"""The gateway keeps the C heap it freed for the next burst (gateway/heap.py), and an operator's MALLOC_*_
variable wins. Each case runs in a fresh interpreter: the settings last for the life of a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# 200 blocks of 100 kB (over pymalloc's 512 bytes, under every mmap threshold: the C heap's top), freed at once;
# RSS is read through an fd opened first, so that reading it puts nothing on the heap above them
PROBE = """
import json, os, sys
from gateway.heap import keep_freed_heap
applied = keep_freed_heap() if sys.argv[1] == "kept" else {}
page = os.sysconf("SC_PAGE_SIZE")
statm = os.open("/proc/self/statm", os.O_RDONLY)
def rss():
    return int(os.pread(statm, 200, 0).split()[1]) * page
blocks = [None] * 200
before = rss()
for i in range(len(blocks)):
    blocks[i] = b"x" * 100_000
grown = rss() - before
blocks = None
print(json.dumps({"applied": applied, "grown": grown, "kept": rss() - before}))
"""
MB = 1_000_000


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=REPO,
                         env={**clean, "PYTHONPATH": str(REPO), **env}, timeout=60, check=True)
    return json.loads(out.stdout)


def test_by_default_a_burst_freed_at_the_heaps_top_is_given_back():
    got = probe("default")
    assert got["grown"] >= 19 * MB, got
    assert got["kept"] < 2 * MB, got  # glibc trims what passes 128 KiB: the next burst faults it in again


def test_the_gateway_keeps_a_burst_it_freed():
    got = probe("kept")
    assert got["applied"] == {"MALLOC_TRIM_THRESHOLD_": 64 << 20, "MALLOC_TOP_PAD_": 16 << 20,
                              "MALLOC_MMAP_THRESHOLD_": 4 << 20}
    assert got["kept"] >= 19 * MB, got


def test_an_operators_variable_wins_over_the_gateways_value():
    got = probe("kept", MALLOC_TRIM_THRESHOLD_="131072")
    assert "MALLOC_TRIM_THRESHOLD_" not in got["applied"]
    assert 15 * MB < got["kept"] < 18 * MB, got  # trimmed to the top pad the gateway still set (16 MiB)
