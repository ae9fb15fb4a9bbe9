"""Running a test's work in several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["run_in_threads"]


def run_in_threads(work: Callable[[int], None], count: int, timeout_s: float) -> None:
    """Run ``work(t)`` for t in ``range(count)``, each in a thread of its own,
    wait up to ``timeout_s`` for each, and assert that none raised (what they
    raised is the assertion's message)."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout_s)
    assert not errors, errors
