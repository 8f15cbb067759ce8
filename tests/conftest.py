"""Every pytest run leaves its reports under build/: build/junit.xml (the JUnit report, named in pyproject's
addopts) and build/durations.txt, each test's setup + call + teardown time, slowest first, so the slow tests of
any run, and which tier they belong to, can be read back after it. `--durations-merge` keeps the entries of the
run before (make test's second part adds its tests to its first part's). Under pytest-xdist only the controller
writes it, from the reports its workers send.

Test files run slowest first: those tests/slow_files.txt names (scripts/slowest_tests.py writes it from a full
run's durations), then by tier, the unit tests last; under pytest-xdist (`make test`), so the longest files
start at once and the many short ones fill the workers' gaps at the end. A file's tests stay together, in order.

A bare `pytest` skips what needs a part this machine lacks (tests/support/needs.py); the run ends by saying how
many tests each missing part held back and which `make` target installs it."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from tests.support.needs import PREFIX

_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-merge", action="store_true",
                     help="add this run's times to build/durations.txt instead of replacing it")


TIERS = ("tests/image/", "tests/integration/", "tests/console/", "tests/hostile/", "tests/contract/",
         "tests/chart/", "tests/unit/")


def slow_first(root) -> dict[str, int]:
    """A rank for each test file: its place in tests/slow_files.txt, then its tier's."""
    hint = root / "tests" / "slow_files.txt"
    named = [line.split()[0] for line in hint.read_text().splitlines() if line and not line.startswith("#")] \
        if hint.exists() else []
    return {file: rank for rank, file in enumerate(named)}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    ranks = slow_first(config.rootpath)

    def rank(item) -> tuple[int, int]:
        file = item.nodeid.split("::", 1)[0]
        tier = next((i for i, prefix in enumerate(TIERS) if file.startswith(prefix)), len(TIERS))
        return ranks.get(file, len(ranks)), tier

    items.sort(key=rank)  # stable: a file's tests keep their order, and so do tests/e2e's (its conftest orders them)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _seconds or hasattr(session.config, "workerinput"):  # an xdist worker: its controller writes
        return
    out = session.config.rootpath / "build" / "durations.txt"
    out.parent.mkdir(exist_ok=True)
    times = dict(_seconds)
    if session.config.getoption("durations_merge") and out.exists():
        for line in out.read_text().splitlines():
            seconds, _, nodeid = line.strip().partition("s  ")
            if nodeid and nodeid not in times:
                times[nodeid] = float(seconds)
    ranked = sorted(times.items(), key=lambda item: item[1], reverse=True)
    out.write_text("".join(f"{seconds:9.3f}s  {nodeid}\n" for nodeid, seconds in ranked))


def held_back(reports) -> Counter[str]:
    """Skipped tests by the part they need (the skip reasons tests/support/needs.py writes)."""
    counts: Counter[str] = Counter()
    for report in reports:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(PREFIX):
            counts[reason] += 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    counts = held_back(terminalreporter.stats.get("skipped", []))
    if not counts:
        return
    terminalreporter.section("held back: parts this machine lacks")
    for reason, count in counts.most_common():
        terminalreporter.write_line(f"{count:5d} tests {reason}")
    terminalreporter.write_line("`make test` installs every part and runs every test; `make check` is the quick "
                                "tier (lint, types, tests/unit).")
