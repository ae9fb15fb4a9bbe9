"""Transfer counters: requests, bytes and a latency histogram per direction,
transport and op, for a node's ``/metrics``.

Two places record into them, each once per unit of work: the batch runner
after a transport ran one slice of a batch (``made``), and the segment
server's loops after they served one request frame (``served``). A record is
a few int adds and one ``bisect`` into the bucket bounds, without a lock: a
scrape reads the cells as they are. Two threads adding to one cell at the
same instant may lose one update (the GIL may switch between the read and
the write of ``+=``); for a metric that is the accepted price of a hot path
without a lock.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass
from enum import Enum

from kvpool.transfer.types import TransferOp

__all__ = ["LATENCY_BUCKETS_S", "CellSnapshot", "Direction", "OpCells", "OpCounter",
           "TransferCounters"]

#: upper bounds (seconds) of the latency histograms' buckets; +Inf is implied
LATENCY_BUCKETS_S: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)


class Direction(Enum):
    """Who moved the bytes: this process's transfer servers for a peer
    (``served``), or this process's own engine (``made``)."""

    SERVED = "served"
    MADE = "made"


class OpCounter:
    """One (direction, transport, op): requests (ranges), bytes, and the
    latency histogram of the units recorded (a request frame served, or a
    batch slice made)."""

    __slots__ = ("buckets", "bytes", "count", "requests", "sum_s")

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self.count = 0
        self.sum_s = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)

    def record(self, requests: int, nbytes: int, seconds: float) -> None:
        """Add one unit of ``requests`` ranges and ``nbytes`` bytes that took ``seconds``."""
        self.requests += requests
        self.bytes += nbytes
        self.count += 1
        self.sum_s += seconds
        self.buckets[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1


#: the cells of one (direction, transport), indexed by ``int(TransferOp)``
#: (index 0 unused): ``cells[req.op].record(...)`` with no lookup on the hot path
OpCells = tuple[OpCounter, OpCounter, OpCounter]


@dataclass(frozen=True, slots=True)
class CellSnapshot:
    """A copy of one cell taken at scrape time; ``buckets`` cumulative (Prometheus ``le``)."""

    direction: Direction
    transport: str
    op: TransferOp
    requests: int
    bytes: int
    count: int
    sum_s: float
    buckets: tuple[int, ...]


class TransferCounters:
    """Every cell of one transfer engine (its servers' and its own transfers),
    plus the transfer failures and failovers of its batches (per transport:
    cold paths). :meth:`cells` hands a loop its cells once; :meth:`snapshot`
    reads them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken when a cell is made, never when one records
        self._cells: dict[tuple[Direction, str], OpCells] = {}
        #: transport -> requests whose attempt on it failed
        self.failures: dict[str, int] = {}
        #: transport -> requests moved off it to the next transport
        self.failovers: dict[str, int] = {}

    def cells(self, direction: Direction, transport: str) -> OpCells:
        """The cells of ``transport`` in ``direction`` (made on first use; the
        same tuple afterwards, so a replaced transport keeps counting on)."""
        key = (direction, transport)
        got = self._cells.get(key)
        if got is None:
            with self._lock:
                got = self._cells.get(key)
                if got is None:
                    got = self._cells[key] = (OpCounter(), OpCounter(), OpCounter())
        return got

    def failed(self, transport: str, n: int = 1) -> None:
        """Count ``n`` requests whose attempt on ``transport`` failed."""
        self.failures[transport] = self.failures.get(transport, 0) + n

    def failed_over(self, transport: str) -> None:
        """Count one request moved from ``transport`` to another."""
        self.failovers[transport] = self.failovers.get(transport, 0) + 1

    def snapshot(self) -> list[CellSnapshot]:
        """A copy of every cell that recorded something."""
        with self._lock:
            items = list(self._cells.items())
        out: list[CellSnapshot] = []
        for (direction, transport), cells in items:
            for op in TransferOp:
                c = cells[int(op)]
                if not c.count:
                    continue
                cum, acc = [], 0
                for n in list(c.buckets):
                    acc += n
                    cum.append(acc)
                # _count is the +Inf bucket (read together with the buckets)
                out.append(CellSnapshot(direction, transport, op, c.requests, c.bytes,
                                        acc, c.sum_s, tuple(cum)))
        return out
