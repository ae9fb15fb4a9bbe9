"""A hand-driven clock for directory-level tests: ``Directory(cfg, clock=c)``,
then move time with ``c.t += seconds``."""

from __future__ import annotations

__all__ = ["Clock"]


class Clock:
    """Returns ``t`` (seconds), which the test sets; starts at 1000.0."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
