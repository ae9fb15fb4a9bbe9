"""SSD-tier policy of the master: offload on eviction, promotion on hit,
file segments that outlive their owner (warm restart).

Pure logic over :class:`~kvpool.master.directory.Directory` (no I/O), like
the directory itself. The master never touches payload bytes, so every copy
between tiers is a **tier task** executed by the node that owns the source
replica (it has the bytes locally): the master hands tasks out in PING
replies (``tasks`` + ``segments``), the node copies with its transfer engine
(WRITE from its own segment's bytes into the destination replica) and reports
with ``TIER_TASK_DONE {client_id, task_id, ok, error}``.

- **Offload on eviction** (``offload_on_evict``: true | false | auto = on
  when a FILE segment is mounted): when eviction picks an object that has a
  memory replica and no disk replica, :meth:`TieringPolicy.on_evict` allocates
  a disk replica (a file segment on the source's host first), queues an
  OFFLOAD task for the memory replica's owner and keeps the object; when the
  node reports success the disk replica joins the object and the memory
  replica is freed (one journal PUT record with the new replica set).
  Above ``offload_ahead_watermark`` the least recently used memory objects
  are copied to disk ahead of time (COPY tasks, memory kept), so eviction is
  immediate for them. If no disk space can be found, or the offload fails or
  times out, the object is evicted the ordinary way (no second attempt).
- **Spill on full**: a put that memory cannot take even after eviction (its
  victims are still being copied to disk) is placed on a FILE segment
  directly (``spill_on_full``; on whenever offload is): a write burst larger
  than memory lands on disk instead of failing (docs/tier.md measures it
  against waiting for the offloads).
- **Promotion on hit** (``promote_on_hit``): the ``promote_after_hits``-th
  read (default 2) of an object that lives only on disk queues a PROMOTE task
  (file owner copies into a new memory replica); on success the memory
  replica is added (journal PUT record). The copy reads the object from disk
  once more, while the reader's own read is still going on or just done: a
  promotion at the first hit slowed cold reads (docs/tier.md); from the
  second hit on, only objects read again pay it.
- **Warm restart**: when a FILE segment's owner expires, the segment is kept
  AWAITING its owner for ``file_owner_ttl_s`` (not dropped); a node restarted
  on the same disk dir mounts the same segment id (from the file header) and
  re-adopts it with its objects. A remount of a FILE segment that is still
  ACTIVE under a dead owner's id is a takeover when the file's generation is
  newer (the file's flock proves the old owner released it).

- **Replica jobs** (Mooncake's copy/move tasks, :mod:`kvpool.master.tier_tasks`):
  each destination is allocated on the named segment at once and copied by
  the source replica's owner as a tier task (REPLICA_COPY / REPLICA_MOVE);
  on success the replica joins the object (a move frees its source, after
  the source's read lease) and the new replica set is journaled (PUT
  record). A job is PENDING until its tasks are handed out, PROCESSING
  until every one reported, then SUCCESS or FAILED (with the reason).

The directory calls the tier hooks (:class:`~kvpool.master.directory.TierHooks`),
the handlers and the server the rest; see each method.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.directory import Directory, TierHooks
from kvpool.master.objects import HARD_PIN, Obj
from kvpool.master.segments import Segment, SegState
from kvpool.master.tier_tasks import (
    CopyTask,
    JobStatus,
    ReplicaJob,
    ReplicaJobs,
    TaskBook,
    TaskKind,
    active_replica,
)
from kvpool.master.tiering_config import TieringConfig

__all__ = ["CopyTask", "JobStatus", "ReplicaJob", "TaskKind", "TieringConfig", "TieringPolicy"]

log = logging.getLogger(__name__)

_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE
_FAILED_MEMORY = 100_000  # keys remembered as "offload failed: evict plainly next time"
_HIT_MEMORY = 100_000  # disk-only keys read recently, with their hit counts
_TO_DISK = frozenset({TaskKind.OFFLOAD, TaskKind.COPY})  # copies that leave memory evictable
_NEEDS_SOURCE = frozenset({TaskKind.OFFLOAD, TaskKind.REPLICA_COPY, TaskKind.REPLICA_MOVE})


class TieringPolicy(TierHooks):
    """The SSD tier (see the module docstring): the directory's tier hooks
    (``on_evict``, ``spill_on_full``, ``on_owner_lost``, ``can_take_over``,
    ``after_restore``), ``on_disk_hit`` (reads), the task protocol
    (``tasks_for``, ``complete``, over :class:`TaskBook`), replica jobs
    (``create_job``, over :class:`ReplicaJobs`), the timer (``tick``) and
    ``stats``."""

    def __init__(self, cfg: TieringConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg or TieringConfig()
        self.cfg.validate()
        self.clock = clock
        self.book = TaskBook(self.cfg, clock)
        self.tasks = self.book.tasks  # the tier tasks in flight, by id
        self.replica_jobs = ReplicaJobs(self.book)
        self.jobs = self.replica_jobs.jobs  # replica jobs, by id (bounded)
        self._failed: dict[str, None] = {}  # insertion-ordered set, bounded
        self._hits: dict[str, int] = {}  # disk hits not yet promoted, oldest first, bounded
        # FILE segments kept after their owner left: id -> (deadline, since)
        self.file_awaiting: dict[str, tuple[float, float]] = {}
        self.counters = {"offload_started": 0, "offload_done": 0, "offload_failed": 0,
                         "copy_ahead_started": 0, "copy_ahead_done": 0,
                         "offload_no_space": 0, "promote_started": 0, "promote_done": 0,
                         "promote_failed": 0, "tasks_expired": 0, "file_segments_kept": 0,
                         "takeovers": 0, "replica_jobs": 0}

    @property
    def inflight_bytes(self) -> int:
        """Bytes the tier tasks in flight copy."""
        return self.book.inflight_bytes

    # ---------------------------------------------------------------- helpers
    def offload_enabled(self, d: Directory) -> bool:
        on = self.cfg.offload_on_evict
        if on == "auto":
            return bool(d.pools[_FILE])
        return bool(on) and bool(d.pools[_FILE])

    def _copy(self, d: Directory, kind: TaskKind, key: str, obj: Obj, src: tuple[Segment, int],
              to: SegmentKind) -> bool | None:
        """Queue a ``kind`` copy of ``obj`` from ``src`` onto a new replica in
        pool ``to`` (on the source's host first). None: no room; False: the
        object went while room was made (nothing queued)."""
        tenants = d.tenants
        if to is _FILE and (key < " " or tenants.track_default):
            tt = tenants.of(key)
            if tt is not None and tt.disk + obj.size > tt.disk_quota:
                return None  # the tenant's disk quota: no copy to disk
        out: list[Any] = []
        host = src[0].desc.host_id
        pref = [s.id for s in d.pools[to] if s.desc.host_id == host]
        if not d.placement.place(obj.size, 1, to, pref, out):
            return None
        if d.objects.get(key) is not obj:  # making room removed it
            d.segtab.free(tuple(out), obj.size)
            return False
        self.book.new(kind, key, obj, src, (out[0], out[1]))
        return True

    @staticmethod
    def _journal_replicas(d: Directory, key: str, obj: Obj) -> None:
        """Record the object's whole replica set (replay: a PUT replaces)."""
        if d.journaling:
            d.records.append(d.objects.put_record(key, obj))

    def _remember_failed(self, key: str) -> None:
        self._failed[key] = None
        if len(self._failed) > _FAILED_MEMORY:
            del self._failed[next(iter(self._failed))]

    # ---------------------------------------------------------------- eviction
    def on_evict(self, d: Directory, key: str, obj: Obj, kind: SegmentKind) -> bool:
        """Directory hook: True = the policy keeps the object for now (an
        offload is queued or running, or its replica is a running task's
        source); False = evict it the ordinary way."""
        t = self.book.by_key.get(key)
        if t is not None:
            if t.obj is not obj:  # stale (object replaced): forget it
                self._cancel(d, t, "object replaced")
            elif t.src.kind == kind:
                return True  # its source replica is being copied: keep it meanwhile
            elif t.kind is TaskKind.PROMOTE and kind == _FILE:
                return True
            else:
                return False
        if kind != _MEM or not self.offload_enabled(d):
            return False
        if active_replica(d, obj, _FILE) is not None:
            return False  # already on disk: just free the memory replica
        if key in self._failed:
            del self._failed[key]
            return False
        src = active_replica(d, obj, _MEM, live_owner=True)
        if src is None or not self.book.budget_ok(obj.size):
            return False
        queued = self._copy(d, TaskKind.OFFLOAD, key, obj, src, _FILE)
        if queued is None:
            self.counters["offload_no_space"] += 1
            return False
        if queued:
            self.counters["offload_started"] += 1
        return True

    def copy_ahead(self, d: Directory, max_scan: int = 4096) -> int:
        """Above ``offload_ahead_watermark`` of memory, queue COPY tasks for
        the least recently used memory-only objects (up to
        ``offload_ahead_bytes``): when eviction reaches them they already have
        a disk replica and their memory is freed at once. Returns tasks queued."""
        ahead = self.cfg.offload_ahead_watermark
        cap = d.pool_cap[_MEM]
        if not ahead or not cap or d.pool_used[_MEM] <= ahead * cap \
                or not self.offload_enabled(d):
            return 0
        budget = self.cfg.offload_ahead_bytes
        running = self.book.by_key
        picked: list[tuple[str, Obj]] = []
        want = 0
        # collect first: allocating disk space may evict (mutate the table)
        for i, (key, obj) in enumerate(d.objects.lru_items()):
            if i >= max_scan or want >= budget:
                break
            if key in running or obj.flags & HARD_PIN or key in self._failed:
                continue
            if active_replica(d, obj, _FILE) is not None:
                continue
            picked.append((key, obj))
            want += obj.size
        queued = 0
        for key, obj in picked:
            if d.objects.get(key) is not obj or not self.book.budget_ok(obj.size):
                continue
            src = active_replica(d, obj, _MEM, live_owner=True)
            if src is None:
                continue
            done = self._copy(d, TaskKind.COPY, key, obj, src, _FILE)
            if done is None:
                self.counters["offload_no_space"] += 1
                break
            if done:
                self.counters["copy_ahead_started"] += 1
                queued += 1
        return queued

    def spill_on_full(self, d: Directory) -> bool:
        """Directory hook: a put that memory cannot take goes to disk whenever
        offload is on (the same switch: memory overflows into the disk tier)."""
        return self.offload_enabled(d)

    # ---------------------------------------------------------------- reads
    def on_disk_hit(self, d: Directory, key: str, obj: Obj, reps: tuple[Any, ...]) -> None:
        """Server hook after a successful GET_REPLICA_LIST: when every
        replica served is on disk, queue a promotion into memory."""
        if not self.cfg.promote_on_hit or key in self.book.by_key or not d.pools[_MEM]:
            return
        for i in range(0, len(reps), 2):
            if reps[i].kind != _FILE:
                return
        if not self._hit_enough(key):
            return
        src = active_replica(d, obj, _FILE, live_owner=True)
        if src is None or not self.book.budget_ok(obj.size):
            return
        if self._copy(d, TaskKind.PROMOTE, key, obj, src, _MEM):
            self.counters["promote_started"] += 1

    def _hit_enough(self, key: str) -> bool:
        """Count a disk hit of ``key``: True at its ``promote_after_hits``-th."""
        need = self.cfg.promote_after_hits
        if need <= 1:
            return True
        hits = self._hits.pop(key, 0) + 1
        if hits >= need:
            return True
        self._hits[key] = hits  # to the end: the oldest are forgotten first
        if len(self._hits) > _HIT_MEMORY:
            del self._hits[next(iter(self._hits))]
        return False

    # ---------------------------------------------------------------- tasks
    def tasks_for(self, d: Directory, client_id: str) -> tuple[list[dict[str, Any]],
                                                               dict[str, Any]]:
        """(task wires, {segment_id: descriptor wire}) to hand to ``client_id``
        in its PING reply; each task is handed out once."""
        return self.book.hand_out(client_id)

    def complete(self, d: Directory, client_id: str, task_id: int, ok: bool,
                 error: str = "") -> ErrorCode:
        """A node reports a task. Applies the replica change on success (and
        journals it); frees the destination on failure. Returns OK, or
        OBJECT_NOT_FOUND for an unknown/expired task, INVALID_WRITE when
        ``client_id`` is not its executor."""
        t = self.book.tasks.get(task_id)
        if t is None:
            return ErrorCode.OBJECT_NOT_FOUND
        if t.executor != client_id:
            return ErrorCode.INVALID_WRITE
        d.touch(client_id)
        if t.cancelled:  # the node is done with it: its destination can be reused now
            self._fail(d, t, "cancelled", count=False)
            return ErrorCode.OK
        if not ok:
            self._fail(d, t, error or "node reported failure")
            return ErrorCode.OK
        obj = t.obj
        reps = obj.replicas
        src_present = any(reps[i] is t.src and reps[i + 1] == t.src_off
                          for i in range(0, len(reps), 2))
        if (d.objects.get(t.key) is not obj or t.dst.state == SegState.DEAD
                or (t.kind in _NEEDS_SOURCE and not src_present)):
            self._fail(d, t, "object changed meanwhile", count=False)
            return ErrorCode.OK
        self.book.forget(t)
        t.dst.keys.add(t.key)
        if t.job is not None:
            obj.replicas = (*reps, t.dst, t.dst_off)
            if t.kind is TaskKind.REPLICA_MOVE:
                self.replica_jobs.drop_source(d, t.key, obj, t.src, t.src_off)
            t.job.finish(True)
        elif t.kind is TaskKind.COPY:
            obj.replicas = (*reps, t.dst, t.dst_off)
            self.counters["copy_ahead_done"] += 1
        elif t.kind is TaskKind.OFFLOAD \
                and max(obj.lease, d.objects.lease_grace_until) > self.clock():
            # read meanwhile (a reader may be copying the memory replica): keep
            # both; the next eviction round frees the memory replica plainly
            obj.replicas = (*reps, t.dst, t.dst_off)
            self.counters["offload_done"] += 1
        elif t.kind is TaskKind.OFFLOAD:
            kept: list[Any] = []
            for i in range(0, len(reps), 2):
                if not (reps[i] is t.src and reps[i + 1] == t.src_off):
                    kept += (reps[i], reps[i + 1])
            obj.replicas = (*kept, t.dst, t.dst_off)
            if not any(s is t.src for s in obj.replicas[::2]):
                t.src.keys.discard(t.key)
            before = d.pool_used[_MEM]
            d.segtab.free((t.src, t.src_off), t.size)
            d.evictor.evictions += 1
            d.evictor.evicted_bytes += before - d.pool_used[_MEM]
            self.counters["offload_done"] += 1
        else:
            obj.replicas = (*reps, t.dst, t.dst_off)
            self.counters["promote_done"] += 1
        tenants = d.tenants
        if t.key < " " or tenants.track_default:
            tenants.rereps(t.key, obj.size, reps, obj.replicas)
        self._journal_replicas(d, t.key, obj)
        if t.kind in _TO_DISK:
            self._evict_copied(d)
        return ErrorCode.OK

    @staticmethod
    def _evict_copied(d: Directory) -> None:
        """A copy to disk landed while memory is above its watermark (it stayed
        full while the copy ran; puts spilled to disk): the copied objects'
        memory can go at once now, so watermark eviction runs in the loop,
        not at the next put (a promotion meanwhile would find no room)."""
        cap = d.pool_cap[_MEM]
        if cap and d.pool_used[_MEM] > d.cfg.eviction_high_watermark * cap:
            d.evictor.evicting.add(_MEM)

    def _cancel(self, d: Directory, t: CopyTask, why: str) -> None:
        """Detach a task from its key. A task already handed out keeps its
        destination allocated until the node reports or the deadline passes
        (a late copy must not land in reused space); an unsent one is failed."""
        if not t.sent:
            self._fail(d, t, why, count=False)
            return
        t.cancelled = True
        if self.book.by_key.get(t.key) is t:
            del self.book.by_key[t.key]

    def _fail(self, d: Directory, t: CopyTask, why: str, count: bool = True) -> None:
        self.book.forget(t)
        d.segtab.free((t.dst, t.dst_off), t.size)
        if t.job is not None:
            t.job.finish(False, why)
        elif count:
            if t.kind is not TaskKind.PROMOTE:
                self.counters["offload_failed"] += 1
                self._remember_failed(t.key)  # next eviction of it drops it plainly
            else:
                self.counters["promote_failed"] += 1
        log.info("tier task %d (%s %s) failed: %s", t.id, t.kind.name, t.key[:64], why)

    def expire_tasks(self, d: Directory) -> int:
        """Timer: fail tasks past their deadline or whose executor is gone.
        An expired OFFLOAD's object is then evicted plainly if memory is still
        above the watermark (the next eviction round). Returns how many."""
        now = self.clock()
        dead = [t for t in self.book.tasks.values()
                if t.deadline < now or t.executor not in d.clients]
        for t in dead:
            self.counters["tasks_expired"] += 1
            self._fail(d, t, "timed out" if t.deadline < now else "executor gone")
        return len(dead)

    # ---------------------------------------------------------------- replica jobs
    def create_job(self, d: Directory, key: str, targets: list[str],
                   source: str = "") -> tuple[ErrorCode, ReplicaJob | None]:
        """Start a replica job (:meth:`ReplicaJobs.create`: copy ``key`` onto
        ``targets``, or move its replica on ``source`` to ``targets[0]``)."""
        code, job = self.replica_jobs.create(d, key, targets, source)
        if job is not None and job.left:
            self.counters["replica_jobs"] += 1
        return code, job

    # ---------------------------------------------------------------- segments
    def on_owner_lost(self, d: Directory, seg: Segment) -> bool:
        """Directory hook when ``seg``'s owner expired (or, after a master
        restart, did not come back within client_ttl): True = the policy kept
        it (a FILE segment now AWAITING its owner for ``file_owner_ttl_s``;
        :meth:`tick` revives it when the owner pings again and drops it at
        the deadline; a mount of the same id re-adopts it)."""
        if seg.kind != _FILE or self.cfg.file_owner_ttl_s <= 0:
            return False
        if seg.state in (SegState.ACTIVE, SegState.SUSPECT):
            d.segtab.deactivate(seg)
            seg.state = SegState.AWAITING
        elif seg.state == SegState.AWAITING:
            d.segtab.forget_awaiting(seg)  # restored after a master restart, owner not back yet
        else:
            return False
        now = self.clock()
        self.file_awaiting[seg.id] = (now + self.cfg.file_owner_ttl_s, now)
        self.counters["file_segments_kept"] += 1
        for t in self.book.of_segment(seg):
            self._fail(d, t, "file segment owner lost", count=False)
        log.info("file segment %s kept awaiting its owner for %.0fs (%d objects)", seg.id,
                 self.cfg.file_owner_ttl_s, len(seg.keys))
        return True

    def can_take_over(self, d: Directory, seg: Segment, desc: SegmentDescriptor) -> bool:
        """Directory hook when a mount names an ACTIVE segment: True when it is
        the same FILE segment reopened by a restarted node (same host, kind,
        size and path, newer file generation); the caller then re-adopts it."""
        if seg.kind != _FILE or desc.kind != _FILE:
            return False
        old = seg.desc
        if (old.host_id != desc.host_id or old.name != desc.name or old.size != desc.size
                or old.base_offset != desc.base_offset):
            return False
        try:
            newer = int(desc.extra.get("generation", 0)) > int(old.extra.get("generation", 0))
        except (TypeError, ValueError):
            return False
        if newer:
            self.counters["takeovers"] += 1
            for t in self.book.of_segment(seg):
                self._fail(d, t, "file segment taken over", count=False)
        return newer

    def after_restore(self, d: Directory) -> None:
        """Directory hook after a master restart. Nothing to do: restored FILE
        segments await their owner like the others (a PING revives them); if
        the owner is not back within client_ttl, :meth:`on_owner_lost` keeps
        them for ``file_owner_ttl_s`` instead of dropping them."""

    def tick(self, d: Directory) -> int:
        """Timer (a few times a second): expire tasks; revive kept FILE
        segments whose owner pinged again; drop those past their deadline or
        already re-adopted by a mount. Returns tasks expired + segments dropped."""
        n = self.expire_tasks(d)
        self.copy_ahead(d)
        if not self.file_awaiting:
            return n
        now = self.clock()
        for sid, (deadline, since) in list(self.file_awaiting.items()):
            seg = d.segments.get(sid)
            if seg is None or seg.state != SegState.AWAITING:
                del self.file_awaiting[sid]  # re-adopted by a mount, or dropped
                continue
            if d.clients.get(seg.owner, -1.0) > since:
                del self.file_awaiting[sid]
                d.segtab.activate(seg)
                log.info("owner %s is back: file segment %s active again", seg.owner, sid)
            elif now > deadline:
                del self.file_awaiting[sid]
                d.drop_segment(seg, "file segment owner did not return")
                n += 1
        return n

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        return {**self.counters, "tier_tasks_inflight": len(self.book.tasks),
                "tier_inflight_bytes": self.book.inflight_bytes,
                "file_segments_awaiting": len(self.file_awaiting)}
