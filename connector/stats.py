"""Connector metrics: the per-interval counters and latency samples vLLM collects.

:class:`ConnectorStats` accumulates one interval in the process running the
connector (scheduler or worker); vLLM pulls it every step through
``get_kv_connector_stats``, sums it over workers and the scheduler
(:func:`merge_stats`), and ships it to the API server, where the
connector's ``build_prom_metrics`` turns it into the ``kvpool_connector_*``
Prometheus series of vLLM's ``/metrics`` (:mod:`kvpool.connector.vllm`).
Nothing here registers a Prometheus metric: in the process that counts,
nobody scrapes.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["FIELDS", "MAX_SAMPLES", "SAMPLES", "ConnectorStats", "merge_stats",
           "reduce_stats"]

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
    "saved_states",         # worker: recurrent states (Mamba) stored, all their layers
    "skipped_states",       # worker: recurrent states already stored
    "loaded_states",        # worker: recurrent states loaded (a hit's resume point)
)


#: latency samples of one interval (lists of seconds), for histograms: one
#: per load job (the loads of one step's requests, until their last layer
#: group arrived) and one per save call (a batch of chunks written)
SAMPLES = ("load_seconds", "save_seconds")
#: samples kept per list (per interval in a process, and when merged); beyond
#: it a sample is dropped from the histogram (its time stays in the sums)
MAX_SAMPLES = 4096


class ConnectorStats:
    """Thread-safe interval counters and samples; :meth:`take` returns and resets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(FIELDS, 0)
        self._total: dict[str, float] = dict.fromkeys(FIELDS, 0)
        self._samples: dict[str, list[float]] = {k: [] for k in SAMPLES}

    def add(self, **values: float) -> None:
        """Add to counters (unknown names raise KeyError)."""
        with self._lock:
            for k, v in values.items():
                if k not in self._data:
                    raise KeyError(k)
                self._data[k] += v
                self._total[k] += v

    def sample(self, name: str, seconds: float) -> None:
        """Record one latency sample of :data:`SAMPLES` (unknown names raise KeyError)."""
        with self._lock:
            got = self._samples[name]
            if len(got) < MAX_SAMPLES:
                got.append(seconds)

    def take(self) -> dict[str, Any]:
        """This interval's counters and samples (then reset); only non-zero
        counters and non-empty sample lists."""
        with self._lock:
            out: dict[str, Any] = {k: v for k, v in self._data.items() if v}
            self._data = dict.fromkeys(FIELDS, 0)
            for k, got in self._samples.items():
                if got:
                    out[k] = got
                    self._samples[k] = []
        return out

    def totals(self) -> dict[str, float]:
        """Counters since creation."""
        with self._lock:
            return dict(self._total)


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two interval dicts (aggregation over workers and intervals): a new
    dict; counters added, sample lists joined (at most :data:`MAX_SAMPLES`).
    Neither argument is changed (vLLM hands one payload to several readers)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, list):
            out[k] = [*out.get(k, ()), *v][:MAX_SAMPLES]
        else:
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
