"""The master's state: the coordinator of its rooms.

Pure logic, no I/O: the server feeds it requests and commits the journal
records it emits (``records``) before it replies. The rooms, each with one job:

- :mod:`~kvpool.master.segments`: the segment table (segments, the pools per
  kind, mount states);
- :mod:`~kvpool.master.liveness`: when clients and their guards were last
  heard (suspect, revive, expire);
- :mod:`~kvpool.master.objects`: the object table (objects, puts in flight,
  pins, groups, leases);
- :mod:`~kvpool.master.placement`: where replicas go, behind
  :class:`~kvpool.master.placement.Placement`;
- :mod:`~kvpool.master.eviction`: what goes when a pool is full, behind
  :class:`~kvpool.master.eviction.EvictionPolicy`;
- :mod:`~kvpool.master.writes`, :mod:`~kvpool.master.reads`,
  :mod:`~kvpool.master.removal`: the ops on objects, each a batch (a single
  key is a batch of one);
- :mod:`~kvpool.master.records` and :mod:`~kvpool.master.replay`: the
  journal records as typed Structs, applied in one place.

:class:`Directory` builds them, holds what spans several (mount, drop,
restore) and the single-key entries; the op handlers call the rooms'
batch forms. :class:`TierHooks` are the points where the SSD tier
(:mod:`kvpool.master.tiering`) takes part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import Evictor, Lru
from kvpool.master.liveness import Liveness
from kvpool.master.objects import HARD_PIN, SOFT_PIN, Obj, ObjectTable, Pending
from kvpool.master.placement import MostFree
from kvpool.master.reads import Reads
from kvpool.master.records import Changes, Rec, SetQuota
from kvpool.master.removal import Removal
from kvpool.master.replay import Replay
from kvpool.master.segments import Segment, SegmentTable, SegState
from kvpool.master.tenants import TenantTable
from kvpool.master.writes import DEFAULT_PUT, PutSpec, Writes, write_grant_ms

__all__ = [
    "HARD_PIN",
    "SOFT_PIN",
    "Directory",
    "Obj",
    "ObjectTable",
    "Pending",
    "Rec",
    "SegState",
    "Segment",
    "TierHooks",
    "write_grant_ms",
]

log = logging.getLogger(__name__)

_MEM = SegmentKind.MEMORY
_ACTIVE = SegState.ACTIVE
_AWAITING = SegState.AWAITING


class TierHooks:
    """Where the SSD tier (:class:`kvpool.master.tiering.TieringPolicy`) takes
    part in the directory's decisions; the defaults change nothing. Each
    hook gets the directory first."""

    def on_evict(self, directory: Directory, key: str, obj: Obj, kind: SegmentKind) -> bool:
        """Eviction picked ``obj``, about to free its replicas in pool
        ``kind``: True = the hooks took the object (e.g. gave it a FILE
        replica and free the memory one once the copy is done); the
        directory leaves it alone."""
        return False

    def on_owner_lost(self, directory: Directory, seg: Segment) -> bool:
        """``seg``'s owner is gone for good: True = the hooks kept ``seg`` (not dropped)."""
        return False

    def can_take_over(self, directory: Directory, seg: Segment,
                      desc: SegmentDescriptor) -> bool:
        """A mount names the ACTIVE segment ``seg``: True = re-adopt it for the caller."""
        return False

    def after_restore(self, directory: Directory) -> None:
        """Called at the end of :meth:`Directory.finish_restore`."""

    def spill_on_full(self, directory: Directory) -> bool:
        """A put that memory cannot take even after eviction: True = place its
        replicas on FILE segments instead (the default: fail the put)."""
        return False


class Directory:
    """Segments + objects + clients (see the module docstring). Per-key
    results are codes (cheap in batches); whole-request errors raise
    KVPoolError. Every state change a client is told about appends a record
    to ``records`` (the server journals them before replying).

    ``hooks``: the tier's."""

    def __init__(self, cfg: MasterConfig, clock: Callable[[], float] = time.monotonic,
                 hooks: TierHooks | None = None, shard_bits: int = 8) -> None:
        self.cfg = cfg
        self.clock = clock
        self.hooks = hooks or TierHooks()
        self.changes = Changes()
        self.records = self.changes.records
        self.segtab = segtab = SegmentTable(cfg, self.changes)
        #: tenants' quotas, usage and counters (kvpool.master.tenants)
        self.tenants = tenants = TenantTable(cfg)
        # shard_bits=0: one shard, exact LRU
        self.objects = objects = ObjectTable(segtab, self.changes, tenants, shard_bits)
        self.liveness = Liveness(cfg, clock, segtab, self)
        self.evictor = Evictor(cfg, clock, segtab, objects, Lru(cfg, objects, segtab))
        self.evictor.directory = self
        tenants.evictor = self.evictor
        self.placement = MostFree(segtab, cfg.eviction_high_watermark, self.evictor.evict)
        self.writes = Writes(cfg, clock, segtab, objects, self.liveness.clients,
                             self.placement, self.evictor.evict, self)
        self.reads = Reads(cfg, clock, objects)
        self.removal = Removal(cfg, clock, objects, self.writes.hold)
        self.replay = Replay(self)
        # the rooms' tables, for readers
        self.segments = segtab.segments
        self.pools = segtab.pools
        self.pool_used = segtab.pool_used
        self.pool_cap = segtab.pool_cap
        self.clients = self.liveness.clients
        self.pending = objects.pending
        self.soft_until = objects.soft_until
        self.group_of = objects.group_of
        self.groups = objects.groups
        self.lease_s = objects.lease_s

    @property
    def journaling(self) -> bool:
        """Whether changes are recorded (off while replaying)."""
        return self.changes.journaling

    @journaling.setter
    def journaling(self, on: bool) -> None:
        self.changes.journaling = on

    # ---------------------------------------------------------------- segments
    def mount(self, client_id: str, desc: SegmentDescriptor) -> None:
        """Mount a segment, or re-adopt the one registered under its id.

        Re-adoption keeps every object: a segment AWAITING its owner after a
        restart, or SUSPECT, comes back when the mount names the same region
        (kind, size, base offset and, for memory, the same shm name: the same
        memory). A memory segment that comes back under its id with another
        shm name is new memory: the old one's objects are dropped first.
        """
        if desc.size <= 0 or desc.base_offset < 0:
            raise KVPoolError("segment size must be > 0 and base_offset >= 0",
                              ErrorCode.INVALID_PARAMS)
        if not desc.segment_id:
            raise KVPoolError("empty segment_id", ErrorCode.INVALID_PARAMS)
        self.liveness.touch(client_id)
        seg = self.segtab.segments.get(desc.segment_id)
        if seg is not None:
            state = seg.state
            if state != _AWAITING and seg.owner != client_id \
                    and self.hooks.can_take_over(self, seg, desc):
                log.info("segment %s reopened by %s: taking over from %s", seg.id, client_id,
                         seg.owner)
            elif state == _ACTIVE:
                raise KVPoolError(f"segment {desc.segment_id} is mounted",
                                  ErrorCode.SEGMENT_ALREADY_EXISTS)
            if (seg.kind != desc.kind or seg.desc.size != desc.size
                    or seg.desc.base_offset != desc.base_offset):
                raise KVPoolError(f"segment {desc.segment_id} differs from the restored one",
                                  ErrorCode.SEGMENT_MISMATCH)
            if seg.kind == _MEM and seg.desc.name != desc.name:
                # same id, other shared memory: the old region's bytes are not in it
                self.drop_segment(seg, f"re-mounted by {client_id} with new memory {desc.name}")
                seg = None
        desc.client_id = client_id
        if seg is not None:
            self.segtab.readopt(seg, desc)
        else:
            self.segtab.add(desc)

    def unmount(self, client_id: str, segment_id: str) -> None:
        """Unmount one of ``client_id``'s segments (its objects go)."""
        seg = self.segtab.segments.get(segment_id)
        if seg is None:
            raise KVPoolError(f"no segment {segment_id}", ErrorCode.SEGMENT_NOT_FOUND)
        if seg.owner != client_id:
            raise KVPoolError(f"segment {segment_id} belongs to another client",
                              ErrorCode.PERMISSION_DENIED)
        self.liveness.touch(client_id)
        self.drop_segment(seg, "unmounted")

    def drop_segment(self, seg: Segment, why: str) -> None:
        """Remove a segment now (recorded); its objects' replicas are purged
        in slices (:meth:`purge_step`); lookups already ignore it."""
        self.objects.force_all()  # (the segment's key set lists every object on it)
        self.objects.purge_later(seg, self.segtab.drop(seg, why))

    def purge_step(self, budget: int) -> int:
        """Remove up to ``budget`` replicas of dropped segments; return the work left."""
        return self.objects.purge_step(budget)

    # ---------------------------------------------------------------- clients
    def touch(self, client_id: str) -> None:
        """``client_id`` itself called now."""
        self.liveness.touch(client_id)

    def ping(self, client_id: str) -> tuple[bool, list[str]]:
        """A PING of the client process: (remount, its segment ids)
        (:meth:`Liveness.ping`)."""
        return self.liveness.ping(client_id)

    def expire_step(self) -> int:
        """The liveness timer (:meth:`Liveness.expire_step`): segments dropped."""
        return self.liveness.expire_step()

    # ---------------------------------------------------------------- one key
    def put_start(self, client_id: str, key: str, size: int, replica_num: int = 1,
                  preferred: Sequence[str] | None = None, flags: int = 0,
                  checksum: Any = None, disk_replica_num: int = 0, soft_pin_ms: int = -1,
                  replace: bool = False, unpin: bool = False,
                  group: str | None = None) -> tuple[int, Pending | None]:
        """:meth:`Writes.put_start_many` of one key: (code, its put in flight)."""
        spec = DEFAULT_PUT if (replica_num, disk_replica_num, flags, soft_pin_ms, replace,
                               unpin) == (1, 0, 0, -1, False, False) and not preferred \
            else PutSpec(replica_num, disk_replica_num, preferred or (), flags, soft_pin_ms,
                         replace, unpin)
        codes = [0]
        self.writes.put_start_many(client_id, (key,), (size,), codes, [None], spec,
                                   None if checksum is None else (checksum,),
                                   None if group is None else (group,))
        return codes[0], None if codes[0] else self.objects.pending[key]

    def put_end(self, client_id: str, key: str) -> int:
        """:meth:`Writes.commit_many` of one key: its code."""
        return self.writes.commit_many(client_id, (key,))[0]

    def put_commit(self, client_id: str, placeholder: str, key: str) -> int:
        """:meth:`Writes.commit_many` of one reservation named ``key``: its code."""
        return self.writes.commit_many(client_id, (key,), (placeholder,))[0]

    def get_replicas(self, key: str) -> tuple[int, Any]:
        """:meth:`Reads.get_replicas_many` of one key: (OK, (object, the
        replicas a reader gets)) with a fresh lease, or (code, None)."""
        codes, objs, found = [0], [None], [None]
        self.reads.get_replicas_many((key,), 0, codes, objs, found)
        return (codes[0], None) if codes[0] else (0, (objs[0], found[0]))

    def remove(self, key: str, force: bool = False) -> int:
        """:meth:`Removal.remove_many` of one key: its code."""
        return self.removal.remove_many((key,), force)[0]

    # ---------------------------------------------------------------- eviction
    def evict(self, kind: SegmentKind, need: int = 0) -> int:
        """:meth:`Evictor.evict`: bytes freed in pool ``kind``."""
        return self.evictor.evict(kind, need)

    def evict_object(self, key: str, obj: Obj, kind: SegmentKind) -> int:
        """:meth:`Evictor.evict_object`: bytes freed."""
        return self.evictor.evict_object(key, obj, kind)

    # ---------------------------------------------------------------- restore
    def apply_records(self, records: Sequence[Any]) -> list[tuple[Any, Exception]]:
        """:meth:`Replay.apply`: the records that failed, with their errors."""
        return self.replay.apply(records)

    def apply_record(self, rec: Any) -> None:
        """:meth:`apply_records` of one record; raises its error."""
        failed = self.replay.apply((rec,))
        if failed:
            raise failed[0][1]

    def restore_segment(self, wire: dict[str, Any]) -> None:
        """A mount while restoring: the segment awaits its owner."""
        self.segtab.restore(wire)

    def finish_restore(self) -> None:
        """After replay: every segment awaits its owner (``client_ttl_s +
        client_grace_s``; a live owner pings within a second)."""
        self.segtab.await_owners(self.clock())
        self.hooks.after_restore(self)
        self.records.clear()
        self.tenants.rebuild(self.objects, self.objects.pending)

    def set_tenant_quota(self, name: str, memory: int, disk: int, guaranteed: int) -> None:
        """Tenant ``name``'s live quotas (-1 = unlimited/none), recorded."""
        self.tenants.set_quota(name, memory, disk, guaranteed)
        if self.changes.journaling:
            self.records.append(SetQuota(name, memory, disk, guaranteed))

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """The directory's counters (StatsReply's fields)."""
        objects = self.objects
        ev = self.evictor
        return {
            "objects": len(objects), **self.segtab.stats(), **self.liveness.stats(),
            **self.writes.stats(), "evictions": ev.evictions,
            "evicted_bytes": ev.evicted_bytes, "lease_refusals": self.removal.lease_refusals,
            "groups": len(objects.groups), "soft_pinned": len(objects.soft_until),
            "restore_unloaded": 0 if objects.unloaded is None else objects.unloaded.count,
        }
