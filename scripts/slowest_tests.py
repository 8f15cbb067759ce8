"""The README's "ten slowest tests" table and tests/slow_files.txt (the files that take longest, which the
parallel part of `make test` starts first), written again from build/durations.txt (what the last `make test`
left: each test's setup + call + teardown, slowest first).

    .venv/bin/python scripts/slowest_tests.py          # rewrite the table and tests/slow_files.txt
    .venv/bin/python scripts/slowest_tests.py --check  # exit 1 when a test the table names no longer exists
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- slowest tests: start -->", "<!-- slowest tests: end -->"
COUNT = 10
SLOW_FILES = ROOT / "tests" / "slow_files.txt"
SLOW_FILE_COUNT = 30


def table(durations: str, count: int = COUNT) -> str:
    rows = ["| seconds | test |", "|---:|---|"]
    for line in durations.splitlines()[:count]:
        seconds, _, nodeid = line.strip().partition("s  ")
        rows.append(f"| {float(seconds):.0f} | `{nodeid}` |")
    return "\n".join(rows)


def slow_files(durations: str, count: int = SLOW_FILE_COUNT) -> str:
    """The files whose tests together take longest, slowest first, with their seconds (tests/e2e apart: that part
    of `make test` runs in one process, in its own order)."""
    seconds: dict[str, float] = {}
    for line in durations.splitlines():
        took, _, nodeid = line.strip().partition("s  ")
        file = nodeid.split("::", 1)[0]
        if nodeid and not file.startswith("tests/e2e/"):
            seconds[file] = seconds.get(file, 0.0) + float(took)
    ranked = sorted(seconds.items(), key=lambda item: item[1], reverse=True)[:count]
    return "".join(f"{file} {took:.0f}\n" for file, took in ranked)


def named(readme: str) -> list[str]:
    """The node ids the README's table names."""
    body = readme.split(START, 1)[1].split(END, 1)[0]
    return re.findall(r"^\| \d+ \| `([^`]+)` \|$", body, flags=re.M)


def exists(nodeid: str) -> bool:
    path, _, rest = nodeid.partition("::")
    function = rest.split("[", 1)[0].split("::")[-1]
    file = ROOT / path
    return file.is_file() and re.search(rf"^\s*(async )?def {re.escape(function)}\(", file.read_text(), re.M) is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--durations", type=Path, default=ROOT / "build" / "durations.txt")
    args = p.parse_args(argv)
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    if args.check:
        gone = [n for n in named(readme) if not exists(n)]
        print("\n".join(f"gone: {n}" for n in gone) or "every test the table names exists")
        return 1 if gone else 0
    durations = args.durations.read_text()
    SLOW_FILES.write_text("# written by scripts/slowest_tests.py: started first by make test (tests/conftest.py)\n"
                          + slow_files(durations))
    head, rest = readme.split(START, 1)
    readme_path.write_text(f"{head}{START}\n{table(durations)}\n{END}{rest.split(END, 1)[1]}",
                           encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
