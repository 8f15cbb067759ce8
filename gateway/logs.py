"""Logging of a process the CLI starts (`serve`, `demo`): one line format on stderr, which the access log
(gateway/access_log.py) then writes to in batches."""

from __future__ import annotations

import logging

from gateway.access_log import write_to_stderr


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    write_to_stderr()  # the access log batches its lines to stderr (gateway/access_log.py)
