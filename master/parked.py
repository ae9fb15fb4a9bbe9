"""PINGs that wait for tier tasks (a long poll).

A client that owns segments (it runs the SSD-tier and replica copy tasks of
their replicas) sends ``Ping(wait_ms=W)``. When the
master has nothing for it (no task, no remount), the serving loop holds the
request instead of answering; it answers it, through the same handler and
the same acknowledgement gate as any request, as soon as a task for that
node is queued (the task book calls :meth:`ParkedPings.release`), when the
same client pings again (a node closing its ping thread), or after ``W`` ms.
So a burst into an idle pool has its offloads picked up within a loop turn
instead of at the node's next ping interval. Each loop turn looks at the
released PINGs and the earliest deadline only: a thousand idle nodes cost
the loop nothing per turn.

Only requests that came through the ZeroMQ socket are held (the ping stub of
a node is a ZeroMQ connection of its own, see
:class:`kvpool.store.segment_host.SegmentHost`); a PING on the direct
same-host socket is answered at once, which a node takes as "no long poll"
(it then pings at its interval, as with a master that predates ``wait_ms``).
A leader that steps down drops what it holds: the nodes' calls time out and
go to the successor.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Any

from kvpool.core.protocol import PING_MAX_WAIT_S

__all__ = ["ParkedPings"]


@dataclass(slots=True, eq=False)
class _Held:
    client_id: str
    frames: list[bytes]
    peer: Any  # the connection's CURVE key (tenant_keys), restored when answered


class ParkedPings:
    """The held PINGs of one serving loop, at most one per client (module
    docstring).

    The loop sets ``allowed`` around its ZeroMQ drain only; the PING handler
    calls :meth:`ask`, and the loop, seeing ``asked`` set after the handler
    returned, :meth:`hold`. Each turn the loop answers :meth:`due`'s when
    :meth:`ready`."""

    def __init__(self) -> None:
        self.allowed = False
        #: (client id, seconds) the PING handler just asked to be held for
        self.asked: tuple[str, float] | None = None
        self._held: dict[str, _Held] = {}
        self._deadlines: list[tuple[float, int, _Held]] = []  # a heap
        self._order = itertools.count()  # (ties in the heap)
        self._now: list[_Held] = []  # to answer at the next turn

    def __len__(self) -> int:
        return len(self._held)

    def ask(self, client_id: str, wait_ms: int) -> bool:
        """The PING handler of ``client_id`` has nothing to hand and the
        request asked to wait: whether it will be held (its reply is then
        discarded, the request answered again later)."""
        if not self.allowed or wait_ms <= 0:
            return False
        self.asked = (client_id, min(wait_ms / 1000, PING_MAX_WAIT_S))
        return True

    def hold(self, frames: list[bytes], peer: Any) -> None:
        """Hold ``frames``, the request whose handler just asked to be held
        (a PING the same client left held before is answered now)."""
        asked = self.asked
        assert asked is not None
        self.asked = None
        client_id, wait_s = asked
        h = _Held(client_id, frames, peer)
        old = self._held.get(client_id)
        if old is not None:
            self._now.append(old)
        self._held[client_id] = h
        heapq.heappush(self._deadlines, (time.monotonic() + wait_s, next(self._order), h))

    def release(self, client_id: str) -> None:
        """Answer ``client_id``'s held PING at the next turn: a task for it
        was queued, or it pinged without waiting."""
        h = self._held.pop(client_id, None)
        if h is not None:
            self._now.append(h)

    def ready(self, now: float) -> bool:
        """Whether :meth:`due` has something to answer."""
        return bool(self._now) or (bool(self._deadlines) and self._deadlines[0][0] <= now)

    def due(self, now: float) -> list[tuple[list[bytes], Any]]:
        """The held PINGs to answer now (forgotten here): released, or past
        their wait; as ``(frames, peer)``."""
        out, self._now = self._now, []
        heap, held = self._deadlines, self._held
        while heap and heap[0][0] <= now:
            h = heapq.heappop(heap)[2]
            if held.get(h.client_id) is h:
                del held[h.client_id]
                out.append(h)
        if not held:
            heap.clear()  # (entries of released PINGs)
        return [(h.frames, h.peer) for h in out]

    def drop(self) -> int:
        """Forget every held PING (the loop stops serving); how many."""
        n = len(self._held) + len(self._now)
        self._held.clear()
        self._deadlines.clear()
        self._now.clear()
        self.asked = None
        return n
