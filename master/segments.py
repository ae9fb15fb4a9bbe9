"""The segment table: every mounted segment, its allocator, and the pools new
replicas are placed in.

A segment is ACTIVE (in its kind's pool: it takes placements), SUSPECT (its
owner went silent: out of the pool, objects kept), AWAITING (restored after
a restart, or a file segment kept after its owner left: objects kept until
the owner is back) or DEAD (dropped; lookups ignore its replicas until they
are purged). The table keeps each pool's used and capacity bytes as running
sums, so a watermark check costs two lookups, and which segments each client
owns (``client_segments``: ACTIVE and SUSPECT ones; ``awaiting``: AWAITING
ones after a restart).

State changes a client is told about are recorded (:class:`Mount`,
:class:`DropSegment`); what a dropped segment held is purged by the object
table (:meth:`ObjectTable.purge_step`).
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import Any

from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.allocator import Allocator
from kvpool.master.config import MasterConfig
from kvpool.master.records import Changes, DropSegment, Mount

__all__ = ["SegState", "Segment", "SegmentTable"]

log = logging.getLogger(__name__)

_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE


class SegState(IntEnum):
    ACTIVE = 0
    AWAITING = 1  # restored after a restart, owner has not come back yet
    DEAD = 2  # dropped; replicas referencing it are being purged
    # its owner missed its pings (busy, stopped, partitioned or dead): no new
    # placements; its replicas are still returned when no ACTIVE one exists;
    # ACTIVE again with every object when the owner pings or re-mounts it
    SUSPECT = 3


_ACTIVE = SegState.ACTIVE
_AWAITING = SegState.AWAITING
_DEAD = SegState.DEAD
_SUSPECT = SegState.SUSPECT


class Segment:
    """A mounted segment and its allocator."""

    __slots__ = ("alloc", "desc", "id", "keys", "kind", "owner", "state", "wire")

    def __init__(self, desc: SegmentDescriptor, alignment: int, state: SegState) -> None:
        self.id = desc.segment_id
        self.desc = desc
        self.kind = desc.kind
        self.owner = desc.client_id
        # ``size`` is the usable size (the region starts at base_offset), as
        # the transfer layer's segments describe themselves
        self.alloc = Allocator(max(desc.size, 0), alignment)
        self.keys: set[str] = set()  # the keys with a replica here
        self.state = state
        self.wire = desc.to_wire()

    def __repr__(self) -> str:
        return f"Segment({self.id!r}, {self.kind.name}, {self.state.name})"


def _unlist(index: dict[str, set[str]], seg: Segment) -> None:
    """Take ``seg`` out of its owner's set in ``index`` (dropping an emptied set)."""
    ids = index.get(seg.owner)
    if ids is not None:
        ids.discard(seg.id)
        if not ids:
            del index[seg.owner]


class SegmentTable:
    """Segments by id, the pools of ACTIVE ones per kind, and who owns what."""

    def __init__(self, cfg: MasterConfig, changes: Changes) -> None:
        self.cfg = cfg
        self.changes = changes
        self.segments: dict[str, Segment] = {}
        self.pools: dict[SegmentKind, list[Segment]] = {_MEM: [], _FILE: []}
        self.pool_used: dict[SegmentKind, int] = {_MEM: 0, _FILE: 0}
        self.pool_cap: dict[SegmentKind, int] = {_MEM: 0, _FILE: 0}
        #: client id -> ids of its ACTIVE and SUSPECT segments
        self.client_segments: dict[str, set[str]] = {}
        #: after a restart: owner client id -> ids of its segments awaiting it
        self.awaiting: dict[str, set[str]] = {}
        self.awaiting_deadline = 0.0
        self.restored_at = 0.0

    def alignment(self, kind: SegmentKind) -> int:
        return self.cfg.file_alignment if kind == _FILE else self.cfg.memory_alignment

    # ---------------------------------------------------------------- states
    def activate(self, seg: Segment) -> None:
        """Make ``seg`` ACTIVE: in its pool, listed under its owner."""
        seg.state = _ACTIVE
        self.pools[seg.kind].append(seg)
        self.pool_used[seg.kind] += seg.alloc.used
        self.pool_cap[seg.kind] += seg.alloc.capacity
        self.client_segments.setdefault(seg.owner, set()).add(seg.id)

    def _unpool(self, seg: Segment) -> None:
        """Take an ACTIVE segment out of its pool (no new placements)."""
        if seg.state == _ACTIVE:
            self.pools[seg.kind].remove(seg)
            self.pool_used[seg.kind] -= seg.alloc.used
            self.pool_cap[seg.kind] -= seg.alloc.capacity

    def deactivate(self, seg: Segment) -> None:
        """Out of its pool and its owner's list (its state is the caller's to set)."""
        self._unpool(seg)
        _unlist(self.client_segments, seg)

    def suspend(self, seg: Segment) -> None:
        """ACTIVE -> SUSPECT: out of the pools (no new placements), objects kept."""
        self._unpool(seg)
        seg.state = _SUSPECT

    def forget_awaiting(self, seg: Segment) -> None:
        """``seg`` no longer awaits its owner (re-adopted, dropped, kept otherwise)."""
        _unlist(self.awaiting, seg)

    def owner_back(self, client_id: str) -> None:
        """The owner of segments awaiting it after a restart pinged: ACTIVE again."""
        for sid in sorted(self.awaiting.pop(client_id, ())):
            self.activate(self.segments[sid])
            log.info("owner %s is back: segment %s active again", client_id, sid)

    # ---------------------------------------------------------------- mount, drop
    def add(self, desc: SegmentDescriptor) -> Segment:
        """A new ACTIVE segment for ``desc`` (recorded)."""
        seg = Segment(desc, self.alignment(desc.kind), _ACTIVE)
        self.segments[seg.id] = seg
        self.activate(seg)
        self._record_mount(seg)
        log.info("mounted %s segment %s (%d B) for %s", desc.kind.name, seg.id, desc.size,
                 desc.client_id)
        return seg

    def readopt(self, seg: Segment, desc: SegmentDescriptor) -> None:
        """``seg`` comes back (same region) as ``desc`` says: possibly a new
        owner id or endpoint; ACTIVE with every object (recorded)."""
        self.forget_awaiting(seg)
        self.deactivate(seg)
        seg.desc, seg.owner, seg.wire = desc, desc.client_id, desc.to_wire()
        self.activate(seg)
        self._record_mount(seg)
        log.info("re-adopted segment %s (%d objects) for %s", seg.id, len(seg.keys),
                 desc.client_id)

    def _record_mount(self, seg: Segment) -> None:
        changes = self.changes
        if changes.journaling:
            changes.records.append(Mount(seg.wire))

    def drop(self, seg: Segment, why: str) -> list[str]:
        """Remove ``seg`` now (recorded); return the keys that had a replica
        on it, for the object table to purge (lookups ignore it at once)."""
        if seg.state == _AWAITING:
            self.forget_awaiting(seg)
        self.deactivate(seg)
        seg.state = _DEAD
        del self.segments[seg.id]
        keys = list(seg.keys)
        seg.keys = set()
        log.info("dropped segment %s (%s)", seg.id, why)
        changes = self.changes
        if changes.journaling:
            changes.records.append(DropSegment(seg.id))
        return keys

    # ---------------------------------------------------------------- space
    def free(self, reps: tuple[Any, ...], size: int) -> None:
        """Give the flat ``(segment, offset, ...)`` replicas of ``size`` bytes
        back to their allocators (those of dropped segments are gone already)."""
        pool_used = self.pool_used
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.state == _DEAD:
                continue
            before = seg.alloc.used
            seg.alloc.release(reps[i + 1], size)
            if seg.state == _ACTIVE:
                pool_used[seg.kind] -= before - seg.alloc.used

    def pool_bytes(self, reps: tuple[Any, ...], size: int, kind: SegmentKind) -> int:
        """The bytes replicas of ``size`` bytes take in the ACTIVE pool ``kind``."""
        n = 0
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.kind == kind and seg.state == _ACTIVE:
                n += seg.alloc.aligned(size)
        return n

    # ---------------------------------------------------------------- restart
    def restore(self, wire: dict[str, Any]) -> None:
        """Apply a mount while restoring: the segment awaits its owner."""
        desc = SegmentDescriptor.from_wire(wire)
        seg = self.segments.get(desc.segment_id)
        if seg is not None:
            seg.desc, seg.owner, seg.wire = desc, desc.client_id, desc.to_wire()
            return
        self.segments[desc.segment_id] = Segment(desc, self.alignment(desc.kind), _AWAITING)

    def await_owners(self, now: float) -> None:
        """After a restart every segment awaits its owner until ``now +
        client_ttl_s + client_grace_s`` (a live owner pings within a second)."""
        self.restored_at = now
        self.awaiting_deadline = now + self.cfg.client_ttl_s + self.cfg.client_grace_s
        self.awaiting.clear()
        for seg in self.segments.values():
            seg.state = _AWAITING
            self.awaiting.setdefault(seg.owner, set()).add(seg.id)

    def wires(self) -> list[dict[str, Any]]:
        """Every segment's descriptor wire map (a snapshot's header)."""
        return [s.wire for s in self.segments.values()]

    def stats(self) -> dict[str, int]:
        used, cap = self.pool_used, self.pool_cap
        return {
            "segments": len(self.segments),
            "memory_used": used[_MEM], "memory_capacity": cap[_MEM],
            "file_used": used[_FILE], "file_capacity": cap[_FILE],
            "bytes_used": used[_MEM] + used[_FILE], "bytes_capacity": cap[_MEM] + cap[_FILE],
            "suspect_segments": sum(1 for s in self.segments.values() if s.state == _SUSPECT),
        }
