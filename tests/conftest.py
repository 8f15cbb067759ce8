"""Every pytest run leaves its reports under build/: build/junit.xml (the JUnit report, named in pyproject's
addopts) and build/durations.txt, each test's setup + call + teardown time, slowest first, so the slow tests of
any run, and which tier they belong to, can be read back after it."""

from __future__ import annotations

from collections import defaultdict

import pytest

_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _seconds:
        return
    out = session.config.rootpath / "build" / "durations.txt"
    out.parent.mkdir(exist_ok=True)
    ranked = sorted(_seconds.items(), key=lambda item: item[1], reverse=True)
    out.write_text("".join(f"{seconds:9.3f}s  {nodeid}\n" for nodeid, seconds in ranked))
