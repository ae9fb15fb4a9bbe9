"""Connector metrics: per-interval counters for vLLM and Prometheus counters.

:class:`ConnectorStats` accumulates one interval (vLLM pulls it every step
through ``get_kv_connector_stats``); every update also increments the
process-wide Prometheus metrics ``kvpool_connector_*`` (default registry, so
``vllm serve``'s ``/metrics`` exposes them).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import Counter, Histogram

__all__ = ["FIELDS", "ConnectorStats", "merge_stats", "reduce_stats"]

# Counter fields of one interval. Latencies are kept as sums plus counts.
FIELDS = (
    "lookups",            # scheduler: prompts looked up
    "lookup_tokens",      # scheduler: prompt tokens looked up
    "hit_tokens",         # scheduler: tokens found in kvpool (beyond local cache)
    "lookup_errors",      # scheduler: existence queries that failed (store down)
    "load_requests",      # worker: requests loaded
    "loaded_chunks",
    "loaded_bytes",
    "load_errors",        # worker: chunks whose load failed (vLLM recomputes them)
    "load_time_s",
    "saved_chunks",
    "saved_bytes",
    "skipped_chunks",     # worker: chunks already stored (not written again)
    "save_errors",
    "save_time_s",
    "save_batches",
    "zero_copy_objects",  # kept for compatibility: 0 since chunk objects span layers
    "staged_objects",     # objects that went through a staging buffer
    "decisions_load",       # scheduler: hits loaded whole
    "decisions_partial",    # scheduler: hits loaded in part (the rest computed)
    "decisions_recompute",  # scheduler: hits computed (loading would be slower)
    "decisions_probe",      # scheduler: hits loaded to measure an unmeasured peer
    "decisions_avoid",      # scheduler: hits computed (their peer failed recently)
    "predicted_load_s",     # scheduler: predicted time of the loads it planned
    "predicted_loads",      # worker: loads that carried a prediction ...
    "predicted_loads_s",    # ... their predicted time ...
    "predicted_loads_actual_s",  # ... and their actual time
    "load_timeouts",        # worker: loads abandoned at their deadline
    "layerwise_loads",      # worker: loads finished layer group by layer group in the forward
)


def _metric(kind: type, name: str, doc: str) -> Any:
    try:
        return kind(name, doc)
    except ValueError:  # already registered (module imported twice): keep it private
        return kind(name, doc, registry=None)


_METRICS: dict[str, Any] = {
    "hit_tokens": _metric(Counter, "kvpool_connector_hit_tokens", "Prompt tokens found in kvpool"),
    "lookup_tokens": _metric(Counter, "kvpool_connector_lookup_tokens", "Prompt tokens looked up"),
    "loaded_bytes": _metric(Counter, "kvpool_connector_loaded_bytes", "KV bytes loaded"),
    "saved_bytes": _metric(Counter, "kvpool_connector_saved_bytes", "KV bytes saved"),
    "load_errors": _metric(Counter, "kvpool_connector_load_errors", "Chunks whose load failed"),
    "save_errors": _metric(Counter, "kvpool_connector_save_errors", "Chunks whose save failed"),
    "load_latency": _metric(Histogram, "kvpool_connector_load_seconds", "Load latency per batch"),
    "save_latency": _metric(Histogram, "kvpool_connector_save_seconds", "Save latency per batch"),
}


class ConnectorStats:
    """Thread-safe interval counters; :meth:`take` returns and resets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(FIELDS, 0)
        self._total: dict[str, float] = dict.fromkeys(FIELDS, 0)

    def add(self, **values: float) -> None:
        """Add to counters (unknown names raise KeyError) and to Prometheus."""
        with self._lock:
            for k, v in values.items():
                if k not in self._data:
                    raise KeyError(k)
                self._data[k] += v
                self._total[k] += v
        for k, v in values.items():
            m = _METRICS.get(k)
            if m is not None and v:
                m.inc(v)
        if values.get("load_time_s"):
            _METRICS["load_latency"].observe(values["load_time_s"])
        if values.get("save_time_s"):
            _METRICS["save_latency"].observe(values["save_time_s"])

    def take(self) -> dict[str, float]:
        """This interval's counters (then reset); only non-zero entries."""
        with self._lock:
            out = {k: v for k, v in self._data.items() if v}
            self._data = dict.fromkeys(FIELDS, 0)
        return out

    def totals(self) -> dict[str, float]:
        """Counters since creation."""
        with self._lock:
            return dict(self._total)


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two interval dicts (aggregation over workers and intervals)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def reduce_stats(data: dict[str, Any]) -> dict[str, int | float]:
    """Summary of an interval for logging: totals plus mean latencies and rates."""
    out: dict[str, int | float] = {k: data[k] for k in FIELDS if data.get(k)}
    if data.get("load_requests"):
        out["avg_load_ms"] = 1000 * data.get("load_time_s", 0) / data["load_requests"]
    if data.get("save_batches"):
        out["avg_save_ms"] = 1000 * data.get("save_time_s", 0) / data["save_batches"]
    if data.get("load_time_s"):
        out["load_GBps"] = data.get("loaded_bytes", 0) / data["load_time_s"] / 1e9
    if data.get("lookup_tokens"):
        out["hit_rate"] = data.get("hit_tokens", 0) / data["lookup_tokens"]
    if data.get("predicted_loads_s"):
        out["load_actual_over_predicted"] = (data.get("predicted_loads_actual_s", 0)
                                             / data["predicted_loads_s"])
    return out
