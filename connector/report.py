"""What a worker measures for the scheduler's load-or-recompute estimates.

Completed loads (peer, bytes, seconds) and peers whose load failed come from
the load pipeline; forward passes (tokens, seconds) are timed here: CUDA
events on a GPU (read when the report is taken, never synchronised on the
forward's thread), the clock on a CPU. :meth:`StepReport.take` hands them
over as one :class:`~kvpool.connector.metadata.WorkerReport`
(``build_connector_worker_meta``). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvpool.connector.metadata import WorkerReport

__all__ = ["StepReport"]


class StepReport:
    """Measurements not yet sent to the scheduler, and the forward being timed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._forward: tuple[int, Any, Any] | None = None  # (tokens, start, end)

    def add_load(self, peer: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._report.loads.append((peer, nbytes, seconds))

    def add_failed_peers(self, peers: list[str]) -> None:
        with self._lock:
            self._report.failed_peers.extend(peers)

    def add_states_saved(self, pins: list[int]) -> None:
        """State saves finished (or given up): their blocks' pins."""
        with self._lock:
            self._report.states_saved.extend(pins)

    def forward_started(self, tokens: int, cuda: bool | None) -> None:
        """Time a forward computing ``tokens`` (``cuda`` None: no cache
        registered yet, nothing is timed)."""
        if not tokens or cuda is None:
            self._forward = None
        elif cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._forward = (tokens, start, None)
        else:
            self._forward = (tokens, time.perf_counter(), None)

    def discard_forward(self) -> None:
        """This forward is no prefill sample (e.g. it waits for loads)."""
        self._forward = None

    def forward_done(self) -> None:
        """The forward is queued (GPU: an end event) or done (CPU: measured)."""
        fw = self._forward
        if fw is None or fw[2] is not None:
            return
        tokens, start, _ = fw
        if isinstance(start, float):
            self._forward = None
            with self._lock:
                self._report.forwards.append((tokens, time.perf_counter() - start))
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._forward = (tokens, start, end)

    def take(self) -> WorkerReport | None:
        """Measurements since the last call (a GPU forward once its end event passed)."""
        fw = self._forward
        if fw is not None and fw[2] is not None and fw[2].query():
            self._forward = None
            with self._lock:
                self._report.forwards.append((fw[0], fw[1].elapsed_time(fw[2]) / 1000.0))
        with self._lock:
            if self._report.is_empty():
                return None
            out, self._report = self._report, WorkerReport()
        return out
