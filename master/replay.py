"""Replay: journal records applied to a directory, snapshots loaded and taken.

:meth:`Replay.apply` is the one place records are applied: a restart
replaying its journals, an HA standby applying the leader's stream, a test.
Replaying is idempotent (a PUT replaces, a REMOVE of an absent key is a
no-op, a replica whose space is not free is skipped), which a fuzzy
snapshot plus the journals written meanwhile rely on
(:mod:`kvpool.master.journal`). The common record, the PUT of a new object
with one replica, is applied inline; a leader allocates in order, so a run
of them placed back to back in one segment (one run per segment: placement
spreads consecutive puts over the segments) is reserved with one allocator
call.

A snapshot holds column chunks (:meth:`Replay.snapshot_chunk`, the format in
:mod:`kvpool.master.journal`) after the segments' wire maps;
:meth:`Replay.bulk_load` loads one into an empty directory with C-level
passes over the columns (the restore of a restart: ~1 µs per object).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from kvpool.core.errors import KVPoolError
from kvpool.master.journal import CHUNK
from kvpool.master.objects import Obj
from kvpool.master.records import DropReplica, DropSegment, Mount, Put, Remove, SetQuota
from kvpool.master.segments import Segment, SegState
from kvpool.master.unloaded import Unloaded

if TYPE_CHECKING:
    import numpy as np

    from kvpool.master.directory import Directory

__all__ = ["Replay"]

log = logging.getLogger(__name__)

_DEAD = SegState.DEAD
_SIZE, _FLAGS, _CHECKSUM, _REPLICAS = (attrgetter(f) for f in ("size", "flags", "checksum",
                                                                "replicas"))
_OFFSET = itemgetter(1)
#: the records that name one key
_KEYED = (Put, Remove, DropReplica)


class Replay:
    """Applies records and snapshots to ``directory`` (see the module docstring)."""

    def __init__(self, directory: Directory) -> None:
        self.d = directory

    def apply(self, records: Sequence[Any]) -> list[tuple[Any, Exception]]:
        """Apply ``records`` in order; return those that failed with their
        errors (the rest applied). A record that is not one of
        :data:`~kvpool.master.records.DirRecord` fails (a raw list: a record
        the decoder could not type)."""
        d = self.d
        objects = d.objects
        if objects.unloaded is not None:  # the records' shards are indexed inline
            objects.force(rec.key for rec in records if type(rec) in _KEYED)
        shards, mask = objects.shards, objects.mask
        segments = d.segtab.segments
        intern = objects.intern_size
        inline = not d.changes.journaling  # the inline PUT builds no record
        failed: list[tuple[Any, Exception]] = []
        # the runs, one per segment: the (record, shard) of the new objects
        # placed back to back at ``[start, end)`` whose space is not reserved
        # yet (a leader spreads consecutive puts over its segments)
        runs: dict[Segment, list[Any]] = {}  # segment -> [start, end, [(record, shard)]]
        for rec in records:
            try:
                if type(rec) is Put and inline:
                    key = rec.key
                    if key < " ":
                        d.tenants.namespaced = True
                    wire = rec.replicas
                    shard = shards[hash(key) & mask]
                    if len(wire) == 2 and key not in shard:
                        seg = segments.get(wire[0])
                        if seg is None:
                            continue  # replicas on unknown segments go
                        off = wire[1]
                        size = rec.size
                        if type(off) is int and type(size) is int:
                            a = seg.alloc.alignment
                            run = runs.get(seg)
                            if run is None or off != run[1]:
                                if run is not None:
                                    self._reserve_run(seg, run[0], run[1], run[2])
                                run = runs[seg] = [off, off, []]
                            shard[key] = Obj(intern(size), (seg, off), rec.flags, rec.checksum)
                            seg.keys.add(key)
                            run[2].append((rec, shard))
                            run[1] = off + ((size + a - 1) & -a if size > 0 else a)
                            continue
                if runs:  # before anything that may depend on the allocator
                    self._reserve_runs(runs)
                self._apply_one(rec)
            except Exception as exc:
                failed.append((rec, exc))
        if runs:
            self._reserve_runs(runs)
        return failed

    def _reserve_runs(self, runs: dict[Segment, list[Any]]) -> None:
        """:meth:`_reserve_run` of every run, emptied."""
        for seg, (start, end, run) in runs.items():
            self._reserve_run(seg, start, end, run)
        runs.clear()

    def _apply_one(self, rec: Any) -> None:
        """Apply one record (the general step of :meth:`apply`)."""
        d = self.d
        objects = d.objects
        if isinstance(rec, Put):
            self.restore_object(rec.key, int(rec.size), int(rec.flags), rec.checksum,
                                list(rec.replicas))
        elif isinstance(rec, Mount):
            d.segtab.restore(rec.segment)
        elif isinstance(rec, DropSegment):
            seg = d.segtab.segments.get(rec.segment_id)
            if seg is not None:
                d.drop_segment(seg, "journal")
                objects.purge_step(1 << 62)
        elif isinstance(rec, Remove):
            obj = objects.get(rec.key)
            if obj is not None:
                objects.remove(rec.key, obj)
        elif isinstance(rec, DropReplica):
            key = rec.key
            obj = objects.get(key)
            seg = d.segtab.segments.get(rec.segment_id)
            if obj is not None and seg is not None:
                reps = obj.replicas
                kept: list[Any] = []
                for i in range(0, len(reps), 2):
                    if reps[i] is seg:
                        seg.alloc.release(reps[i + 1], obj.size)
                        seg.keys.discard(key)
                    else:
                        kept += (reps[i], reps[i + 1])
                if kept:
                    obj.replicas = tuple(kept)
                else:
                    objects.remove(key, obj)
        elif isinstance(rec, SetQuota):
            d.tenants.set_quota(rec.name, rec.memory, rec.disk, rec.guaranteed)
        else:
            raise ValueError(f"not a journal record: {rec!r:.200}")

    @staticmethod
    def _reserve_run(seg: Segment, start: int, end: int,
                     run: list[tuple[Put, dict[str, Obj]]]) -> None:
        """Reserve the space of ``run`` (new objects placed back to back at
        ``[start, end)`` in ``seg``) and empty it. One call for all of them;
        if that range is not wholly free, object by object, dropping those
        whose space is not free (as :meth:`restore_object`)."""
        try:
            seg.alloc.reserve(start, end - start)
        except KVPoolError:
            for rec, shard in run:
                key = rec.key
                try:
                    seg.alloc.reserve(rec.replicas[1], rec.size)
                except KVPoolError as exc:
                    log.debug("restore: %s: %s", key, exc)
                    del shard[key]
                    seg.keys.discard(key)
        run.clear()

    def restore_object(self, key: str, size: int, flags: int, checksum: Any,
                       wire: list[Any]) -> None:
        """An object as a PUT record or a snapshot states it (replacing the
        key's; replicas on unknown segments or on space not free are skipped)."""
        d = self.d
        objects = d.objects
        old = objects.shards[hash(key) & objects.mask].get(key)
        if old is not None:
            objects.remove(key, old)
        reps: list[Any] = []
        segments = d.segtab.segments
        for i in range(0, len(wire), 2):
            seg = segments.get(wire[i])
            if seg is None:
                continue
            try:
                seg.alloc.reserve(wire[i + 1], size)
            except KVPoolError as exc:
                # expected with a fuzzy snapshot: the journal replay fixes it
                log.debug("restore: %s: %s", key, exc)
                continue
            reps += (seg, wire[i + 1])
        if reps:
            objects.complete(key, objects.intern_size(size), tuple(reps), flags, checksum)

    # ---------------------------------------------------------------- snapshots
    def snapshot_record(self, key: str) -> list[Any] | None:
        """The snapshot record of ``key`` now, or None if it is gone."""
        obj = self.d.objects.get(key)
        if obj is None:
            return None
        reps = obj.replicas
        if len(reps) == 2 and reps[0].state != _DEAD:
            return [key, obj.size, obj.flags, obj.checksum, [reps[0].id, reps[1]]]
        wire: list[Any] = []
        for i in range(0, len(reps), 2):
            if reps[i].state != _DEAD:
                wire += (reps[i].id, reps[i + 1])
        return [key, obj.size, obj.flags, obj.checksum, wire] if wire else None

    def snapshot_chunk(self, keys: Sequence[str]) -> tuple[list[Any], int]:
        """The column chunk of ``keys`` now (:mod:`kvpool.master.journal`: the
        objects with one live replica as columns per segment, the others as
        records; keys gone are left out) and how many objects it holds."""
        objects = self.d.objects
        shards, mask = objects.shards, objects.mask
        # per segment: its keys and objects (the columns are made from them in C)
        groups: dict[Segment, tuple[list[str], list[Obj]]] = {}
        others: list[list[Any]] = []
        for key in keys:
            obj = shards[hash(key) & mask].get(key)
            if obj is None:
                continue
            reps = obj.replicas
            seg = reps[0]
            if len(reps) == 2 and seg.state != _DEAD:
                g = groups.get(seg)
                if g is None:
                    g = groups[seg] = ([], [])
                g[0].append(key)
                g[1].append(obj)
            else:
                rec = self.snapshot_record(key)
                if rec is not None:
                    others.append(rec)
        cols = [[seg.id, ks, list(map(_SIZE, objs)), list(map(_FLAGS, objs)),
                 list(map(_CHECKSUM, objs)), list(map(_OFFSET, map(_REPLICAS, objs)))]
                for seg, (ks, objs) in groups.items()]
        return [CHUNK, cols, others], sum(len(g[0]) for g in groups.values()) + len(others)

    def bulk_load(self, segments: list[dict[str, Any]], items: Iterable[list[Any]]) -> int:
        """Load a snapshot (:func:`kvpool.master.journal.iter_snapshot`'s
        items) into an empty directory, to be served at once: its objects
        are filed under their load buckets as rows of the decoded columns
        and made a bucket at a time later (:mod:`kvpool.master.unloaded`); each
        segment's allocator is rebuilt now from its sorted ranges (C-level
        passes, no per-object Python). Replicas on unknown segments are
        skipped. When ranges overlap (possible in a fuzzy snapshot; the
        journal replay fixes it), everything is loaded and each overlapping
        replica after the first is dropped (an object left without one
        goes). Return the number of objects loaded or to load."""
        import numpy as np  # (here: a master that restores nothing does not load it)

        d = self.d
        segtab = d.segtab
        for wire in segments:
            segtab.restore(wire)
        segs = segtab.segments
        objects = d.objects
        sizes_of = objects._sizes
        intern = objects.intern_size
        unloaded = Unloaded(objects.mask)
        # per segment: the offsets and sizes of its records' replicas (the
        # columns' come from the columns)
        per_seg: dict[Segment, tuple[list[int], list[int]]] = {}
        for item in items:
            if item[0] != CHUNK:  # a version-1 record
                self._add_records([item], unloaded, per_seg)
                continue
            for seg_id, keys, sizes, flags, checksums, offsets in item[1]:
                seg = segs.get(seg_id)
                if seg is None or not keys:
                    continue  # replicas on unknown segments go
                for size in set(sizes):
                    intern(size)
                # one int object per size (KV-cache objects share a few sizes)
                sizes = list(map(sizes_of.get, sizes, sizes))
                unloaded.add_column(seg, keys, sizes, flags, checksums, offsets)
            if item[2]:
                self._add_records(item[2], unloaded, per_seg)
        unloaded.seal()
        if unloaded.columns.keys and min(unloaded.columns.keys) < " ":
            d.tenants.namespaced = True  # a tenant's key (tenants.rebuild counts them)
        if unloaded.count:
            objects.unloaded = unloaded
        ranges = unloaded.columns.ranges()
        empty = np.zeros(0, np.int64)
        for seg, (offs, sizes) in per_seg.items():
            o, z = ranges.get(seg, (empty, empty))
            ranges[seg] = (np.concatenate((o, np.asarray(offs, np.int64))),
                           np.concatenate((z, np.asarray(sizes, np.int64))))
        if not all([self._rebuild(seg, *ranges.pop(seg, (empty, empty)))
                    for seg in segs.values()]):
            self._load_with_conflicts()
        return len(objects)

    def _add_records(self, records: Iterable[list[Any]], unloaded: Unloaded,
                     per_seg: dict[Segment, tuple[list[int], list[int]]]) -> None:
        """Add a snapshot's object records (:meth:`snapshot_record`) to
        ``unloaded`` and list their replicas' ranges."""
        segs = self.d.segtab.segments
        intern = self.d.objects.intern_size
        for key, size, flags, checksum, wire in records:
            reps: list[Any] = []
            for i in range(0, len(wire), 2):
                seg = segs.get(wire[i])
                if seg is not None:
                    reps += (seg, wire[i + 1])
            if not reps:
                continue
            if key < " ":
                self.d.tenants.namespaced = True
            size = intern(size)
            unloaded.add_record(key, size, flags, checksum, tuple(reps))
            for i in range(0, len(reps), 2):
                lists = per_seg.setdefault(reps[i], ([], []))
                lists[0].append(reps[i + 1])
                lists[1].append(size)

    @staticmethod
    def _rebuild(seg: Segment, offsets: np.ndarray, sizes: np.ndarray) -> bool:
        """Rebuild ``seg``'s allocator from its replicas' ranges; False (the
        allocator unchanged) when they overlap or do not fit."""
        import numpy as np

        alloc = seg.alloc
        a = alloc.alignment
        lengths = (np.maximum(sizes, 1) + (a - 1)) & -a  # (Allocator.aligned)
        order = np.argsort(offsets, kind="stable")
        return alloc.rebuild(offsets[order], lengths[order])

    def _load_with_conflicts(self) -> None:
        """:meth:`bulk_load` when some segment's ranges overlap: load every
        object, then rebuild each segment from what the table holds, keeping
        each range that fits after the ones kept before it."""
        import numpy as np

        d = self.d
        objects = d.objects
        u = objects.unloaded
        keys_in_order = [] if u is None else [*u.columns.keys, *u.records.keys]
        objects.force_all()
        per_seg: dict[Segment, tuple[list[int], list[int], list[str]]] = {}
        seen: set[str] = set()
        # in the snapshot's order: of two replicas on one range, the first stays
        for key in keys_in_order:
            if key in seen:
                continue  # (a key that came twice: the later copy is the table's)
            seen.add(key)
            obj = objects.get(key)
            if obj is None:
                continue
            reps = obj.replicas
            for i in range(0, len(reps), 2):
                lists = per_seg.setdefault(reps[i], ([], [], []))
                lists[0].append(reps[i + 1])
                lists[1].append(obj.size)
                lists[2].append(key)
        for seg in d.segtab.segments.values():
            offsets, sizes, keys = per_seg.pop(seg, ([], [], []))
            seg.keys.clear()
            seg.keys.update(keys)
            if self._rebuild(seg, np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)):
                continue
            alloc = seg.alloc
            lengths = [alloc.aligned(max(s, 1)) for s in sizes]
            order = sorted(range(len(offsets)), key=offsets.__getitem__)
            self._load_conflicts(seg, list(map(offsets.__getitem__, order)),
                                 list(map(lengths.__getitem__, order)),
                                 list(map(keys.__getitem__, order)))

    def _load_conflicts(self, seg: Segment, offsets: list[int], lengths: list[int],
                        keys: list[str]) -> None:
        """:meth:`bulk_load`'s rebuild of ``seg`` when its ranges (sorted by
        offset) overlap or are out of bounds: keep each range that fits after
        the ones kept before it, drop the others' replicas (an object left
        without one goes)."""
        alloc = seg.alloc
        objects = self.d.objects
        kept_offsets: list[int] = []
        kept_lengths: list[int] = []
        pos = 0
        for off, length, key in zip(offsets, lengths, keys, strict=True):
            if off >= pos and not off % alloc.alignment and off + length <= alloc.capacity:
                kept_offsets.append(off)
                kept_lengths.append(length)
                pos = off + length
                continue
            log.debug("bulk load: dropping replica of %s on %s (conflict)", key, seg.id)
            obj = objects.get(key)
            if obj is None:
                continue
            old = obj.replicas
            obj.replicas = tuple(x for j in range(0, len(old), 2)
                                 if not (old[j] is seg and old[j + 1] == off)
                                 for x in (old[j], old[j + 1]))
            if seg not in obj.replicas[::2]:
                seg.keys.discard(key)
            if not obj.replicas:
                del objects[key]
        ok = alloc.rebuild(kept_offsets, kept_lengths)
        assert ok
