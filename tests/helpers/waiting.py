"""Wait on a condition instead of sleeping a fixed time and hoping it holds (a loaded 2-core machine
makes any fixed sleep too short sometimes)."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.01) -> bool:
    """Poll `cond()` until it is true (returns True) or `timeout_s` seconds pass (returns False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
