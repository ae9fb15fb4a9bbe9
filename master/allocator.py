"""Offset allocator for one segment: best-fit over a coalescing free list.

The free space is two parallel views kept in sync with ``bisect``:
``_starts``/``_lens`` sorted by offset (for coalescing neighbours on free) and
``_by_size`` sorted by ``(length, offset)`` (for best fit). Every operation is
O(log n) searches plus a C-level list insert/delete. Allocations themselves
are not recorded: the caller releases with the same ``(offset, size)`` it got,
which keeps per-object memory at zero here.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.core.errors import ErrorCode, KVPoolError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Allocator"]


class Allocator:
    """Allocate aligned ranges of ``[0, capacity)``.

    ``alignment`` (a power of two) rounds every size up and keeps every offset
    aligned. ``allocate`` returns an offset or -1; ``release`` and ``reserve``
    raise INVALID_PARAMS on ranges that are not currently allocated / free.
    """

    __slots__ = ("_by_size", "_lens", "_starts", "alignment", "capacity", "free", "used")

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self.used = 0
        self.free = self.capacity  # capacity - used, kept as a slot for fast max()
        self._starts: list[int] = []
        self._lens: list[int] = []
        self._by_size: list[tuple[int, int]] = []
        if self.capacity > 0:
            self._add_free(0, self.capacity)

    def aligned(self, size: int) -> int:
        """``size`` rounded up to the alignment (what an allocation really takes)."""
        a = self.alignment
        return (size + a - 1) & -a

    def _add_free(self, off: int, length: int) -> None:
        i = bisect_left(self._starts, off)
        self._starts.insert(i, off)
        self._lens.insert(i, length)
        insort(self._by_size, (length, off))

    def _del_free_at(self, i: int) -> None:
        off = self._starts.pop(i)
        length = self._lens.pop(i)
        j = bisect_left(self._by_size, (length, off))
        del self._by_size[j]

    def allocate(self, size: int) -> int:
        """Best-fit allocation of ``size`` bytes; return the offset or -1 when full."""
        a = self.alignment
        need = (size + a - 1) & -a if size > 0 else a  # aligned(max(size, 1)), inlined
        by_size = self._by_size
        j = bisect_left(by_size, (need, -1))
        if j == len(by_size):
            return -1
        length, off = by_size[j]
        starts = self._starts
        i = bisect_left(starts, off)
        if length == need:
            del by_size[j]
            del starts[i]
            del self._lens[i]
        else:
            # keep the remainder in place (its start moves up by need)
            rest = (length - need, off + need)
            starts[i] = off + need
            self._lens[i] = length - need
            if j and by_size[j - 1] > rest:
                del by_size[j]
                insort(by_size, rest)
            else:  # still in order where its block was (the common case: no move)
                by_size[j] = rest
        self.used += need
        self.free -= need
        return off

    def allocate_run(self, size: int, count: int) -> tuple[int, int]:
        """Up to ``count`` allocations of ``size`` bytes at once: ``(offset, k)``,
        the ``k`` (>= 1) ranges ``offset + m * aligned(size)``, or ``(-1, 0)``
        when full. The same ranges and free list as ``k`` calls of
        ``allocate(size)``: after a best-fit carve the block's remainder is
        smaller than every other block that fits, so it is the next best fit
        while it holds one more. A caller that uses fewer gives the tail back
        with one ``release`` (it coalesces into the remainder: the state is as
        if only those were allocated)."""
        a = self.alignment
        need = (size + a - 1) & -a if size > 0 else a
        by_size = self._by_size
        j = bisect_left(by_size, (need, -1))
        if j == len(by_size) or count <= 0:
            return -1, 0
        length, off = by_size[j]
        k = min(count, length // need)
        take = k * need
        starts = self._starts
        i = bisect_left(starts, off)
        del by_size[j]
        if length == take:
            del starts[i]
            del self._lens[i]
        else:
            starts[i] = off + take
            self._lens[i] = length - take
            insort(by_size, (length - take, off + take))
        self.used += take
        self.free -= take
        return off, k

    def reserve(self, off: int, size: int) -> None:
        """Mark ``[off, off+aligned(size))`` allocated (restoring state after a restart)."""
        need = self.aligned(max(size, 1))
        if off % self.alignment or off < 0:
            raise KVPoolError(f"unaligned offset {off}", ErrorCode.INVALID_PARAMS)
        starts, lens = self._starts, self._lens
        i = bisect_right(starts, off) - 1
        if i < 0 or starts[i] + lens[i] < off + need:
            raise KVPoolError(f"range {off}+{need} is not free", ErrorCode.INVALID_PARAMS)
        start, length = starts[i], lens[i]
        if start == off and length > need:
            # the front of a free block (replay of allocations, in order): the
            # block shrinks in place, as allocate() does
            by_size = self._by_size
            j = bisect_left(by_size, (length, start))
            rest = (length - need, off + need)
            starts[i] = off + need
            lens[i] = length - need
            if j and by_size[j - 1] > rest:
                del by_size[j]
                insort(by_size, rest)
            else:
                by_size[j] = rest
            self.used += need
            self.free -= need
            return
        self._del_free_at(i)
        if off > start:
            self._add_free(start, off - start)
        end = off + need
        if start + length > end:
            self._add_free(end, start + length - end)
        self.used += need
        self.free -= need

    def rebuild(self, offsets: Sequence[int] | np.ndarray,
                lengths: Sequence[int] | np.ndarray) -> bool:
        """Reset to exactly the allocated ranges ``offsets[i], lengths[i]``
        (aligned lengths, offsets sorted): bulk restore, numpy passes over
        the ranges. False (nothing changed) when they are not sorted,
        overlap, are unaligned or pass the capacity."""
        import numpy as np  # (here: a master that restores nothing does not load it)

        offs = np.asarray(offsets, np.int64)
        ends = offs + np.asarray(lengths, np.int64)
        # the gaps before each range and after the last one: a negative one is
        # an overlap (or a range before 0 or past the capacity)
        gap_starts = np.concatenate((np.zeros(1, np.int64), ends))
        gap_lens = np.concatenate((offs, np.asarray([self.capacity], np.int64))) - gap_starts
        if gap_lens.min() < 0:
            return False
        free = gap_lens > 0  # the empty gaps left out
        starts, lens = gap_starts[free], gap_lens[free]
        # the lengths are aligned: every offset is iff every gap is
        if np.any(lens & (self.alignment - 1)):
            return False
        by_size = np.lexsort((starts, lens))
        self._starts, self._lens = starts.tolist(), lens.tolist()
        self._by_size = list(zip(lens[by_size].tolist(), starts[by_size].tolist(), strict=True))
        self.free = int(lens.sum())
        self.used = self.capacity - self.free
        return True

    def release(self, off: int, size: int) -> None:
        """Return a range obtained from ``allocate``/``reserve``; coalesces neighbours."""
        need = self.aligned(max(size, 1))
        if off < 0 or off + need > self.capacity or off % self.alignment:
            raise KVPoolError(f"bad free of {off}+{need}", ErrorCode.INVALID_PARAMS)
        starts, lens = self._starts, self._lens
        i = bisect_left(starts, off)
        # overlap checks: a double free would corrupt the free list
        if i < len(starts) and starts[i] < off + need:
            raise KVPoolError(f"double free of {off}+{need}", ErrorCode.INVALID_PARAMS)
        if i > 0 and starts[i - 1] + lens[i - 1] > off:
            raise KVPoolError(f"double free of {off}+{need}", ErrorCode.INVALID_PARAMS)
        start, end = off, off + need
        merge_next = i < len(starts) and starts[i] == end
        merge_prev = i > 0 and starts[i - 1] + lens[i - 1] == start
        if merge_next:
            end = starts[i] + lens[i]
            self._del_free_at(i)
        if merge_prev:
            start = starts[i - 1]
            self._del_free_at(i - 1)
        self._add_free(start, end - start)
        self.used -= need
        self.free += need

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_blocks(self) -> int:
        return len(self._starts)

    def fragmentation(self) -> float:
        """1 - largest free block / total free (0: one contiguous hole; ->1: shattered)."""
        free = self.free_bytes
        if free <= 0:
            return 0.0
        return 1.0 - self.largest_free / free

    def check(self) -> None:
        """Assert internal consistency (tests)."""
        assert self._starts == sorted(self._starts)
        assert sorted(zip(self._lens, self._starts, strict=True)) == self._by_size
        total = 0
        for k in range(len(self._starts)):
            assert self._lens[k] > 0
            if k:
                assert self._starts[k - 1] + self._lens[k - 1] < self._starts[k], "uncoalesced"
            total += self._lens[k]
        assert total == self.capacity - self.used == self.free
