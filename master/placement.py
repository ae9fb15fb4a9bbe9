"""Placement: which segments a new object's replicas go to (as Mooncake's
``AllocationStrategy``), behind one small interface.

:class:`Placement` is what the write path asks: :meth:`~Placement.place`
(up to ``n`` replicas on distinct segments of a kind, making room by
eviction when the pool is full), :meth:`~Placement.place_one` (the common
put: one memory replica), :meth:`~Placement.plan_run` (a run of equal-sized
puts of a batch placed at once, exactly as one by one would place them) and
:meth:`~Placement.allocate_on` (a named segment, for replica jobs).
:class:`MostFree` is the master's: the segment with the most free bytes
first (a sample of the pool when it has more than 32 segments).
"""

from __future__ import annotations

import operator
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.core.protocol import SegmentKind
from kvpool.master.segments import Segment, SegmentTable, SegState

__all__ = ["MakeRoom", "MostFree", "Placement", "unplan"]

_MEM = SegmentKind.MEMORY
_ACTIVE = SegState.ACTIVE
_FREE = operator.attrgetter("alloc.free")
#: pools up to this many segments are ranked whole; larger ones are sampled
_RANKED = 32

#: ``make_room(kind, need) -> bytes freed``: eviction in pool ``kind`` (need 0:
#: down to the watermark's target)
MakeRoom = Callable[[SegmentKind, int], int]


def unplan(plan: list[tuple[Segment, int]], used: int, size: int) -> None:
    """Give back the ranges (of ``size``) of ``plan`` past its first ``used``."""
    for seg, off in plan[used:]:
        seg.alloc.release(off, size)


class Placement(ABC):
    """Where replicas go. Every method allocates what it returns (the caller
    owns the ranges) and keeps the segment table's pool sums, except
    :meth:`plan_run`, whose ranges the caller accounts as it uses them."""

    @abstractmethod
    def candidates(self, kind: SegmentKind, n: int, preferred: list[str],
                   exclude: list[Segment]) -> Iterator[Segment]:
        """ACTIVE segments of ``kind`` in the order replicas should be tried:
        ``preferred`` first; never one in ``exclude`` (which the iteration
        extends with the preferred ones it yields)."""

    @abstractmethod
    def place(self, size: int, n: int, kind: SegmentKind, preferred: list[str],
              out: list[Any]) -> int:
        """Allocate up to ``n`` replicas of ``size`` on distinct segments of
        ``kind`` (evicting when full); append ``(segment, offset)`` to
        ``out``; return how many."""

    @abstractmethod
    def place_one(self, size: int, out: list[Any]) -> bool:
        """One memory replica of ``size`` where it fits at once (no eviction
        for room; a pool above its watermark is evicted after): appended to
        ``out``. False: the caller falls back to :meth:`place`."""

    @abstractmethod
    def plan_run(self, size: int, m: int) -> list[tuple[Segment, int]] | None:
        """The ``(segment, offset)`` of up to ``m`` memory replicas of ``size``
        as :meth:`place_one` would give them one after another, carved at
        once (fewer when the pool runs out). None, nothing carved: the run
        must be placed one by one. The pool sums are the caller's to update
        per replica used; :func:`unplan` gives the rest back."""

    @abstractmethod
    def allocate_on(self, seg: Segment, size: int) -> int:
        """``size`` bytes on ``seg`` itself (ACTIVE), evicting from its pool
        once when it is full; the offset, or -1."""


class MostFree(Placement):
    """The segment with the most free bytes first; pools of more than 32
    segments are sampled (power of choices) instead of ranked whole."""

    def __init__(self, segtab: SegmentTable, high_watermark: float, make_room: MakeRoom,
                 rng: random.Random | None = None) -> None:
        self.segtab = segtab
        self.mem_pool = segtab.pools[_MEM]  # (one list for the table's life)
        self.high = high_watermark
        self.make_room = make_room
        self.rng = rng or random.Random()

    def candidates(self, kind: SegmentKind, n: int, preferred: list[str],
                   exclude: list[Segment]) -> Iterator[Segment]:
        segments = self.segtab.segments
        for sid in preferred:
            seg = segments.get(sid)
            if seg is not None and seg.kind == kind and seg.state == _ACTIVE \
                    and seg not in exclude:
                exclude.append(seg)
                yield seg
        pool = self.segtab.pools[kind]
        if len(pool) > _RANKED:
            # power of choices: sample a few, most free first
            pool = self.rng.sample(pool, min(len(pool), 2 * n + 6))
        for seg in sorted(pool, key=_FREE, reverse=True):
            if seg not in exclude:
                yield seg

    def place(self, size: int, n: int, kind: SegmentKind, preferred: list[str],
              out: list[Any]) -> int:
        segtab = self.segtab
        if n <= 0 or not segtab.pools[kind]:
            return 0
        pool_used = segtab.pool_used
        got = 0
        taken: list[Segment] = []
        attempts = 4
        for attempt in range(attempts):
            excl = list(taken)
            full = 0  # candidates that had no room (the only shortfall eviction can mend)
            for seg in self.candidates(kind, n, preferred if attempt == 0 else [], excl):
                before = seg.alloc.used
                off = seg.alloc.allocate(size)
                if off < 0:
                    full += 1
                    continue
                taken.append(seg)
                excl.append(seg)
                pool_used[kind] += seg.alloc.used - before
                out += (seg, off)
                got += 1
                if got == n:
                    break
            if got == n or attempt == attempts - 1 or not full:
                # (every candidate took a replica: fewer segments than replicas,
                # e.g. one of two holders suspect. Evicting cannot add a segment;
                # it would only throw away other objects, put after put)
                break
            # an allocation failed: make room (LRU eviction) and retry the rest;
            # freed space may be scattered, so each retry frees twice as much
            if not self.make_room(kind, size * (n - got) << attempt):
                break
        cap = segtab.pool_cap[kind]
        if cap and pool_used[kind] > self.high * cap:
            self.make_room(kind, 0)
        return got

    def place_one(self, size: int, out: list[Any]) -> bool:
        segtab = self.segtab
        pool = segtab.pools[_MEM]
        if not pool:
            return False
        if len(pool) > _RANKED:
            pool = self.rng.sample(pool, 8)
        seg = max(pool, key=_FREE) if len(pool) > 1 else pool[0]
        alloc = seg.alloc
        before = alloc.used
        off = alloc.allocate(size)
        if off < 0:
            return False
        used = segtab.pool_used[_MEM] + alloc.used - before
        segtab.pool_used[_MEM] = used
        out += (seg, off)
        if used > self.high * segtab.pool_cap[_MEM]:
            self.make_room(_MEM, 0)
        return True

    def plan_run(self, size: int, m: int) -> list[tuple[Segment, int]] | None:
        pool = self.mem_pool
        s = len(pool)
        if m == 1 and 0 < s <= _RANKED:  # (a single key): the most free, first on ties
            seg = max(pool, key=_FREE) if s > 1 else pool[0]
            off = seg.alloc.allocate(size)
            return [(seg, off)] if off >= 0 else None
        if s == 1:  # the ranges allocate() would give one by one, from one block
            seg = pool[0]
            off, k = seg.alloc.allocate_run(size, m)
            if not k:
                return None
            need = seg.alloc.aligned(size)
            return [(seg, off + t * need) for t in range(k)]
        if not 1 < s <= _RANKED:
            return None
        need = pool[0].alloc.aligned(size)
        if any(seg.alloc.aligned(size) != need for seg in pool):
            return None
        frees = [seg.alloc.free for seg in pool]
        lo = min(frees)
        if max(frees) - lo < need and lo >= need * (m // s + 1):
            # frees within one allocation of each other, room for every pick:
            # each round picks every segment once, most free first (first on
            # ties), and leaves them in the same order
            ranked = sorted(range(s), key=lambda j: (-frees[j], j))
            q, r = divmod(m, s)
            segs = [pool[j] for j in ranked]
            offs = [0] * s
            for rank, seg in enumerate(segs):
                want = q + (rank < r)
                if not want:
                    break
                off, k = seg.alloc.allocate_run(size, want)
                if k != want:  # fragmented: give back what was carved
                    if k:
                        seg.alloc.release(off, k * need)
                    for back in range(rank):
                        segs[back].alloc.release(offs[back], (q + (back < r)) * need)
                    return None
                offs[rank] = off
            return [(segs[t % s], offs[t % s] + (t // s) * need) for t in range(m)]
        # otherwise simulate the picks (each the most free segment, the first
        # on ties) and carve each segment's share
        sim = frees[:]
        counts = [0] * s
        order: list[int] = []
        for _ in range(m):
            top = max(sim)
            if top < need:
                break
            j = sim.index(top)
            sim[j] = top - need
            counts[j] += 1
            order.append(j)
        carved: list[list[int]] = [[] for _ in pool]
        for j, want in enumerate(counts):
            alloc = pool[j].alloc
            got = carved[j]
            while len(got) < want:
                off, k = alloc.allocate_run(size, want - len(got))
                if k == 0:  # fragmented: give back what was carved
                    for jj in range(j + 1):
                        for o in carved[jj]:
                            pool[jj].alloc.release(o, need)
                    return None
                got.extend(range(off, off + k * need, need))
        its = [iter(c) for c in carved]
        return [(pool[j], next(its[j])) for j in order] or None

    def allocate_on(self, seg: Segment, size: int) -> int:
        if seg.state != _ACTIVE:
            return -1
        for attempt in range(2):
            before = seg.alloc.used
            off = seg.alloc.allocate(size)
            if off >= 0:
                self.segtab.pool_used[seg.kind] += seg.alloc.used - before
                return off
            if attempt or not self.make_room(seg.kind, size):
                break
        return -1
