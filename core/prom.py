"""What the master's and the node daemon's Prometheus collectors share."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily

__all__ = ["labelled_counter"]


def labelled_counter(name: str, text: str, labels: list[str],
                     rows: Iterable[tuple[list[str], float]]) -> CounterMetricFamily:
    """A counter family with one sample per ``(label values, count)`` row
    (``_total`` is added by the exposition)."""
    c = CounterMetricFamily(name, text, labels=labels)
    for values, n in rows:
        c.add_metric(values, n)
    return c
