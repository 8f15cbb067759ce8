"""Every pytest run leaves its reports under build/: build/junit.xml (the JUnit report, named in pyproject's
addopts) and build/durations.txt, each test's setup + call + teardown time, slowest first, so the slow tests of
any run, and which tier they belong to, can be read back after it. `--durations-merge` keeps the entries of the
run before (make test's second part adds its tests to its first part's). Under pytest-xdist only the controller
writes it, from the reports its workers send.

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
