"""Replay: journal records applied to a directory, snapshots loaded and taken.

:meth:`Replay.apply` is the one place records are applied: a restart
replaying its journals, an HA standby applying the leader's stream, a test.
Replaying is idempotent (a PUT replaces, a REMOVE of an absent key is a
no-op, a replica whose space is not free is skipped), which a fuzzy
snapshot plus the journals written meanwhile rely on
(:mod:`kvpool.master.journal`). The common record, the PUT of a new object
with one replica, is applied inline; a leader allocates in order, so a run
of them placed back to back in one segment is reserved with one allocator
call.

A snapshot holds ``[key, size, flags, checksum, [segment_id, offset, ...]]``
per object (:meth:`Replay.snapshot_record`) after the segments' wire maps
(:meth:`Replay.bulk_load` loads one into an empty directory).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.core.errors import KVPoolError
from kvpool.master.objects import Obj
from kvpool.master.records import DropReplica, DropSegment, Mount, Put, Remove, SetQuota
from kvpool.master.segments import Segment, SegState

if TYPE_CHECKING:
    from kvpool.master.directory import Directory

__all__ = ["Replay"]

log = logging.getLogger(__name__)

_DEAD = SegState.DEAD


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
        shards, mask = objects.shards, objects.mask
        segments = d.segtab.segments
        intern = objects.intern_size
        inline = not d.changes.journaling  # the inline PUT builds no record
        failed: list[tuple[Any, Exception]] = []
        # the run: (record, shard) of the new objects placed in ``run_seg`` at
        # ``[run_start, run_end)`` whose space is not reserved yet
        run: list[tuple[Put, dict[str, Obj]]] = []
        run_seg: Segment | None = None
        run_start = run_end = 0
        for rec in records:
            try:
                if type(rec) is Put and inline:
                    key = rec.key
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
                            if seg is not run_seg or off != run_end:
                                if run:
                                    self._reserve_run(run_seg, run_start, run_end, run)
                                run_seg = seg
                                run_start = off
                            shard[key] = Obj(intern(size), (seg, off), rec.flags, rec.checksum)
                            seg.keys.add(key)
                            run.append((rec, shard))
                            run_end = off + ((size + a - 1) & -a if size > 0 else a)
                            continue
                if run:  # before anything that may depend on the allocator
                    self._reserve_run(run_seg, run_start, run_end, run)
                self._apply_one(rec)
            except Exception as exc:
                failed.append((rec, exc))
        if run:
            self._reserve_run(run_seg, run_start, run_end, run)
        return failed

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
    def _reserve_run(seg: Segment | None, start: int, end: int,
                     run: list[tuple[Put, dict[str, Obj]]]) -> None:
        """Reserve the space of ``run`` (new objects placed back to back at
        ``[start, end)`` in ``seg``) and empty it. One call for all of them;
        if that range is not wholly free, object by object, dropping those
        whose space is not free (as :meth:`restore_object`)."""
        assert seg is not None
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

    def bulk_load(self, segments: list[dict[str, Any]], records: Iterable[list[Any]]) -> int:
        """Load a snapshot into an empty directory fast: objects first, then
        each segment's allocator rebuilt from its sorted ranges. A replica
        overlapping an earlier one (possible in a fuzzy snapshot; the journal
        replay fixes it) is dropped. Return the number of objects loaded."""
        d = self.d
        segtab = d.segtab
        for wire in segments:
            segtab.restore(wire)
        segs = segtab.segments
        objects = d.objects
        intern = objects.intern_size
        for key, size, flags, checksum, wire in records:
            reps: list[Any] = []
            for i in range(0, len(wire), 2):
                seg = segs.get(wire[i])
                if seg is not None:
                    reps += (seg, wire[i + 1])
            if reps and key not in objects:
                objects[key] = Obj(intern(size), tuple(reps), flags, checksum)
        per_seg: dict[Segment, list[tuple[int, str]]] = {seg: [] for seg in segs.values()}
        for key, obj in objects.items():
            oreps = obj.replicas
            for i in range(0, len(oreps), 2):
                per_seg[oreps[i]].append((oreps[i + 1], key))
        for seg, entries in per_seg.items():
            entries.sort()
            alloc = seg.alloc
            ranges: list[tuple[int, int]] = []
            pos = 0
            keys = seg.keys
            for off, key in entries:
                obj = objects[key]
                length = alloc.aligned(obj.size)
                if off < pos or off % alloc.alignment or off + length > alloc.capacity:
                    log.debug("bulk load: dropping replica of %s on %s (conflict)", key, seg.id)
                    old = obj.replicas
                    obj.replicas = tuple(x for j in range(0, len(old), 2)
                                         if not (old[j] is seg and old[j + 1] == off)
                                         for x in (old[j], old[j + 1]))
                    continue
                ranges.append((off, length))
                keys.add(key)
                pos = off + length
            alloc.rebuild(ranges)
        empty = [k for k, o in objects.items() if not o.replicas]
        for k in empty:
            del objects[k]
        return len(objects)
