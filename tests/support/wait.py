"""Polling until a condition holds, for tests that watch other processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout_s: float, what: str,
               interval_s: float = 0.05) -> T:
    """Call ``pred`` every ``interval_s`` until it returns something truthy and
    return that; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
