"""A restored snapshot's objects that are not in the object table yet.

A restart serves before its snapshot is loaded (the 10M-object restore took
tens of seconds, during which a single master answered nothing). The
restore decodes the snapshot, rebuilds every segment's allocator from its
columns and files each object under its load bucket (the low bits of its
key's hash: a few hundred objects each, bucket ``b`` belonging to shard
``b & shard_mask``) as a row of the decoded columns joined end to end:
C-level and numpy passes, no per-object Python. The objects are made later,
a bucket at a time:

- at the first touch of a key of that bucket (a lookup, a put, a journal
  record replayed: :meth:`ObjectTable.force`);
- by the serving loop between requests (:meth:`ObjectTable.load_step`);
- all at once before a pass over the whole table (a snapshot, a removal by
  pattern, a dropped segment's purge), or a shard's before a listing page.

Objects are made with use tick 0: never used since the restart, they are
older than any object used since, and the LRU walk takes the buckets not
made yet first (:meth:`ObjectTable.lru_items`), each in the snapshot's
order (its shard's use order when it was written).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from itertools import pairwise, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from kvpool.master.objects import Obj
    from kvpool.master.segments import Segment

__all__ = ["Unloaded", "release_heap"]


def release_heap() -> None:
    """Give the heap pages a restore's temporaries (decoded chunks, the
    per-segment range lists) left free back to the OS: glibc keeps them
    otherwise, ~10% of the RSS of millions of restored objects (a few ms)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return
    trim(0)


class _Rows:
    """Columns joined end to end: row ``r`` is an object (``keys[r]``,
    ``sizes[r]``, ...). ``places[r]``: its offset on the segment of its
    run (``run_starts``/``run_segs``: the row where each column began, and
    its segment), or, for the rows of records (``run_segs`` None), its
    flat replica tuple. After :meth:`seal`, ``order`` lists the rows bucket
    by bucket (each in row order) and ``bounds[i]`` where bucket ``i``'s begin."""

    def __init__(self, with_segments: bool) -> None:
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.flags: list[int] = []
        self.checksums: list[Any] = []
        self.places: list[Any] = []
        self.run_starts: list[int] = []
        self.run_segs: list[Segment] | None = [] if with_segments else None
        self.order: np.ndarray | None = None
        self.bounds: list[int] = []
        self.seg_index: np.ndarray | None = None  # per row: its run's segment's index

    def extend(self, keys: list[str], sizes: list[int], flags: list[int],
               checksums: list[Any], places: list[Any], seg: Segment | None) -> None:
        if self.run_segs is not None:
            self.run_starts.append(len(self.keys))
            self.run_segs.append(seg)  # type: ignore[arg-type]
        self.keys += keys
        self.sizes += sizes
        self.flags += flags
        self.checksums += checksums
        self.places += places

    def seal(self, mask: int) -> None:
        """Order the rows by bucket (``hash & mask``: a C-level pass over the
        keys' hashes, which stay cached in the strings for the table's own
        lookups)."""
        import numpy as np  # (here: a master that restores nothing does not load it)

        n = len(self.keys)
        bucket = (np.fromiter(map(hash, self.keys), np.int64, n) & mask).astype(
            np.uint16 if mask > 255 else np.uint8)
        self.order = np.argsort(bucket, kind="stable")  # a radix sort: O(n)
        self.bounds = np.searchsorted(bucket[self.order], np.arange(mask + 2)).tolist()
        if self.run_segs is not None and n:
            segs: dict[Segment, int] = {}
            idx = [segs.setdefault(s, len(segs)) for s in self.run_segs]
            lens = np.diff(np.append(np.asarray(self.run_starts, np.int64), n))
            self.seg_index = np.repeat(np.asarray(idx, np.int32), lens)
            self.run_segs = list(segs)

    def ranges(self) -> dict[Segment, tuple[np.ndarray, np.ndarray]]:
        """Per segment, the offsets and sizes of its rows (after :meth:`seal`)."""
        import numpy as np

        run_segs, seg_index = self.run_segs, self.seg_index
        if run_segs is None or seg_index is None:
            return {}
        offs = np.asarray(self.places, np.int64)
        sizes = np.asarray(self.sizes, np.int64)
        if len(run_segs) == 1:
            return {run_segs[0]: (offs, sizes)}
        order = np.argsort(seg_index, kind="stable")
        si = seg_index[order]
        cuts = [0, *(np.flatnonzero(np.diff(si)) + 1).tolist(), len(si)]
        return {run_segs[int(si[a])]: (offs[order[a:b]], sizes[order[a:b]])
                for a, b in pairwise(cuts)}

    def bucket_rows(self, i: int) -> np.ndarray:
        assert self.order is not None
        return self.order[self.bounds[i]:self.bounds[i + 1]]

    def take(self, rows: np.ndarray) -> tuple[list[str], list[Obj],
                                              list[tuple[Segment, list[str]]] | None]:
        """The keys of ``rows`` and their new objects; per segment, the keys
        with a replica on it (None for record rows: their objects say)."""
        from kvpool.master.objects import Obj

        rl = rows.tolist()
        if len(rl) == 1:
            r = rl[0]
            keys, sizes, flags, checksums, places = [self.keys[r]], [self.sizes[r]], \
                [self.flags[r]], [self.checksums[r]], [self.places[r]]
        else:
            pick = itemgetter(*rl)
            keys = list(pick(self.keys))
            sizes, flags, checksums, places = (pick(self.sizes), pick(self.flags),
                                               pick(self.checksums), pick(self.places))
        run_segs = self.run_segs
        if run_segs is None or self.seg_index is None:
            objs = list(map(Obj, sizes, places, flags, checksums, repeat(""), repeat(0.0),
                            repeat(0)))
            return keys, objs, None
        segs = list(map(run_segs.__getitem__, self.seg_index[rows].tolist()))
        objs = list(map(Obj, sizes, zip(segs, places, strict=True), flags, checksums,
                        repeat(""), repeat(0.0), repeat(0)))
        per_seg: dict[Segment, list[str]] = {}
        for seg, key in zip(segs, keys, strict=True):
            got = per_seg.get(seg)
            if got is None:
                per_seg[seg] = [key]
            else:
                got.append(key)
        return keys, objs, list(per_seg.items())


class Unloaded:
    """The snapshot's rows, indexed by load bucket (``hash(key) & bmask``,
    the bits chosen by :meth:`seal`: bucket ``b`` fills shard ``b & shard_mask``), and
    which buckets are not made yet (see the module docstring). A bucket
    holds a few hundred objects, so a request makes little more than its
    own keys' objects. ``count``: objects not made yet."""

    #: objects per load bucket aimed at (the bucket bits grow with the snapshot)
    BUCKET_OBJECTS = 512

    def __init__(self, shard_mask: int) -> None:
        self.shard_mask = shard_mask
        self.bmask = shard_mask
        self.columns = _Rows(with_segments=True)  # objects with one replica
        self.records = _Rows(with_segments=False)  # the others
        #: per bucket: True while its rows are not made
        self.pending: list[bool | None] = []
        self.count = 0
        self.buckets_left = 0
        self._next = 0  # the next bucket load_step looks at

    def add_column(self, seg: Segment, keys: list[str], sizes: list[int], flags: list[int],
                   checksums: list[Any], offsets: list[int]) -> None:
        """Objects with one replica on ``seg`` (a snapshot's column)."""
        self.columns.extend(keys, sizes, flags, checksums, offsets, seg)

    def add_record(self, key: str, size: int, flags: int, checksum: Any,
                   replicas: tuple[Any, ...]) -> None:
        """An object with its flat replica tuple (a snapshot's record)."""
        r = self.records
        r.keys.append(key)
        r.sizes.append(size)
        r.flags.append(flags)
        r.checksums.append(checksum)
        r.places.append(replicas)

    def seal(self) -> None:
        """Index the rows by bucket (after the last add)."""
        self.count = n = len(self.columns.keys) + len(self.records.keys)
        bits = max(self.shard_mask.bit_length(),
                   min(16, (n // self.BUCKET_OBJECTS).bit_length()))
        self.bmask = (1 << bits) - 1
        pending: list[bool | None] = [None] * (self.bmask + 1)
        for t in (self.columns, self.records):
            t.seal(self.bmask)
            b = t.bounds
            for i in range(self.bmask + 1):
                if b[i + 1] > b[i]:
                    pending[i] = True
        self.pending = pending
        self.buckets_left = sum(1 for p in pending if p)

    def buckets_of_shard(self, i: int) -> range:
        """The load buckets that fill shard ``i``."""
        return range(i, self.bmask + 1, self.shard_mask + 1)

    def take(self, b: int) -> Iterator[tuple[list[str], list[Obj],
                                             list[tuple[Segment, list[str]]] | None]]:
        """Bucket ``b``'s objects, made and taken out: per table, (keys, their
        objects, the keys per segment or None: the objects' replicas say)."""
        if self.pending[b] is None:
            return
        self.pending[b] = None
        self.buckets_left -= 1
        for t in (self.columns, self.records):
            rows = t.bucket_rows(b)
            if len(rows):
                self.count -= len(rows)
                yield t.take(rows)

    def next_bucket(self) -> int | None:
        """A bucket not made yet (in order), or None."""
        pending = self.pending
        n = len(pending)
        i = self._next
        while i < n:
            if pending[i] is not None:
                self._next = i + 1
                return i
            i += 1
        self._next = n
        return None

    def entries(self, namespaced: bool) -> Iterator[tuple[str, tuple[Any, ...], int]]:
        """``(key, replicas, size)`` of every object not made yet
        (``namespaced``: only keys below U+0020, a tenant's), for a recount
        of usage."""
        import numpy as np

        pending, bmask = self.pending, self.bmask
        for t in (self.columns, self.records):
            keys = t.keys
            if not keys:
                continue
            if namespaced:  # the tenants' rows, found at C speed
                if min(keys) >= " ":
                    continue
                rows: Iterable[int] = np.flatnonzero(
                    np.fromiter(map(" ".__gt__, keys), bool, len(keys))).tolist()
            else:
                rows = range(len(keys))
            run_segs, seg_index, places, sizes = t.run_segs, t.seg_index, t.places, t.sizes
            for r in rows:
                key = keys[r]
                if pending[hash(key) & bmask] is None:
                    continue  # made: the table holds it
                reps = places[r] if run_segs is None or seg_index is None \
                    else (run_segs[int(seg_index[r])], places[r])
                yield key, reps, sizes[r]
