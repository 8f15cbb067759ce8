"""The type of the HTTP shell's runner of background work (gateway/background.py `Background.run`): it takes a
coroutine, runs it off the request path and never raises, so a policy step hands it writes that must not delay a
request (a slot released, a budget settled, the shared variant weights written)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

Background = Callable[[Coroutine[Any, Any, object]], None]
