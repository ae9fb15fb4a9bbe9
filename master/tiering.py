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
  than memory lands on disk instead of failing. Measured against waiting for
  the offloads (docs/tier.md): ~3x the burst throughput, no put stalls.
- **Promotion on hit** (``promote_on_hit``): the ``promote_after_hits``-th
  read (default 2) of an object that lives only on disk queues a PROMOTE task
  (file owner copies into a new memory replica); on success the memory
  replica is added (journal PUT record). The copy reads the object from disk
  once more, while the reader's own read is still going on or just done: a
  promotion at the first hit halved cold reads (0.45x the disk through the
  store, docs/tier.md); from the second hit on, only objects read again pay it.
- **Warm restart**: when a FILE segment's owner expires, the segment is kept
  AWAITING its owner for ``file_owner_ttl_s`` (not dropped); a node restarted
  on the same disk dir mounts the same segment id (from the file header) and
  re-adopts it with its objects. A remount of a FILE segment that is still
  ACTIVE under a dead owner's id is a takeover when the file's generation is
  newer (the file's flock proves the old owner released it).

- **Replica jobs** (Mooncake's copy/move tasks, ``CREATE_COPY_TASK`` /
  ``CREATE_MOVE_TASK`` / ``QUERY_TASK``): copy an object's replica onto named
  segments, or move it from one segment to another. Each destination is
  allocated on the named segment at once and copied by the source replica's
  owner as a tier task (REPLICA_COPY / REPLICA_MOVE); on success the replica
  joins the object (a move frees its source, after the source's read lease)
  and the new replica set is journaled (PUT record). A job is PENDING until
  its tasks are handed out, PROCESSING until every one reported, then
  SUCCESS or FAILED (with the reason); finished jobs are remembered (the
  newest ``_JOB_MEMORY``) for QUERY_TASK, not journaled.

The directory and server call the hooks below; see ``docs`` in each method.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.directory import Directory, TierHooks
from kvpool.master.objects import HARD_PIN, Obj
from kvpool.master.segments import Segment, SegState
from kvpool.master.tiering_config import TieringConfig

__all__ = ["CopyTask", "JobStatus", "ReplicaJob", "TaskKind", "TieringConfig", "TieringPolicy"]

log = logging.getLogger(__name__)

_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE
_FAILED_MEMORY = 100_000  # keys remembered as "offload failed: evict plainly next time"
_HIT_MEMORY = 100_000  # disk-only keys read recently, with their hit counts
_JOB_MEMORY = 100_000  # replica jobs remembered for QUERY_TASK (oldest forgotten first)


class TaskKind(IntEnum):
    OFFLOAD = 1  # memory replica -> new disk replica, then free the memory replica
    PROMOTE = 2  # disk replica -> new memory replica (disk replica kept)
    COPY = 3  # memory replica -> new disk replica, memory kept (offload ahead of eviction)
    REPLICA_COPY = 4  # a replica job's copy onto a named segment (source kept)
    REPLICA_MOVE = 5  # a replica job's move: the source replica is freed on success


class JobStatus(IntEnum):
    """State of a replica job (Mooncake's TaskStatus values)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


@dataclass(eq=False)
class ReplicaJob:
    """A copy or move of one object's replica onto named segments (Mooncake's
    copy/move task). ``left``: its tier tasks still running; times are epoch ms."""

    id: int
    move: bool
    key: str
    executor: str
    created_ms: int
    updated_ms: int
    status: JobStatus = JobStatus.PENDING
    message: str = ""
    left: int = 0

    def finish(self, ok: bool, message: str = "") -> None:
        """Record a task's outcome: FAILED at the first failure, SUCCESS when
        the last task succeeded."""
        self.updated_ms = time.time_ns() // 1_000_000
        if not ok:
            self.status = JobStatus.FAILED
            self.message = self.message or message
            return
        self.left -= 1
        if self.left <= 0 and self.status != JobStatus.FAILED:
            self.status = JobStatus.SUCCESS


@dataclass(eq=False)
class CopyTask:
    """One copy between tiers, executed by ``executor`` (the source's owner)."""

    id: int
    kind: TaskKind
    key: str
    obj: Obj
    size: int
    src: Segment
    src_off: int
    dst: Segment
    dst_off: int
    executor: str
    deadline: float
    sent: bool = False
    cancelled: bool = False  # its object went away while the node may be copying
    job: ReplicaJob | None = None  # the replica job it belongs to, if any

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "kind": int(self.kind), "key": self.key, "size": self.size,
                "src": [self.src.id, self.src_off], "dst": [self.dst.id, self.dst_off]}


_NEEDS_SOURCE = frozenset({TaskKind.OFFLOAD, TaskKind.REPLICA_COPY, TaskKind.REPLICA_MOVE})


class TieringPolicy(TierHooks):
    """Eviction policy + task book-keeping of the SSD tier (see module doc).

    Implements the directory's tier hooks (``TierHooks``: ``on_evict``, ...
    ``on_disk_hit`` (reads), ``on_owner_lost``/``can_take_over``
    (segments), ``tasks_for``/``complete``/``tick``
    (the task protocol and timers) and ``stats``.
    """

    def __init__(self, cfg: TieringConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg or TieringConfig()
        self.cfg.validate()
        self.clock = clock
        self._ids = itertools.count(1)
        self.tasks: dict[int, CopyTask] = {}
        self._by_key: dict[str, CopyTask] = {}
        self._queues: dict[str, list[CopyTask]] = {}
        self._failed: dict[str, None] = {}  # insertion-ordered set, bounded
        self._hits: dict[str, int] = {}  # disk hits not yet promoted, oldest first, bounded
        self.inflight_bytes = 0
        self.jobs: dict[int, ReplicaJob] = {}  # replica jobs, oldest first (bounded)
        self._job_ids = itertools.count(1)
        # FILE segments kept after their owner left: id -> (deadline, since)
        self.file_awaiting: dict[str, tuple[float, float]] = {}
        self.counters = {"offload_started": 0, "offload_done": 0, "offload_failed": 0,
                         "copy_ahead_started": 0, "copy_ahead_done": 0,
                         "offload_no_space": 0, "promote_started": 0, "promote_done": 0,
                         "promote_failed": 0, "tasks_expired": 0, "file_segments_kept": 0,
                         "takeovers": 0, "replica_jobs": 0}

    # ---------------------------------------------------------------- helpers
    def offload_enabled(self, d: Directory) -> bool:
        on = self.cfg.offload_on_evict
        if on == "auto":
            return bool(d.pools[_FILE])
        return bool(on) and bool(d.pools[_FILE])

    @staticmethod
    def _active_replica(d: Directory, obj: Obj, kind: SegmentKind,
                        live_owner: bool = False) -> tuple[Segment, int] | None:
        reps = obj.replicas
        for i in range(0, len(reps), 2):
            seg = reps[i]
            if seg.kind == kind and seg.state == SegState.ACTIVE \
                    and (not live_owner or seg.owner in d.clients):
                return seg, reps[i + 1]
        return None

    @staticmethod
    def _same_host(d: Directory, kind: SegmentKind, host_id: str) -> list[str]:
        return [s.id for s in d.pools[kind] if s.desc.host_id == host_id]

    def _budget_ok(self, size: int) -> bool:
        cap = self.cfg.max_inflight_bytes
        return not cap or self.inflight_bytes + size <= cap

    def _new_task(self, kind: TaskKind, key: str, obj: Obj, src: tuple[Segment, int],
                  dst: tuple[Segment, int]) -> CopyTask:
        t = CopyTask(next(self._ids), kind, key, obj, obj.size, src[0], src[1], dst[0], dst[1],
                     src[0].owner, self.clock() + self.cfg.task_timeout_s)
        self.tasks[t.id] = t
        self._by_key[key] = t
        self._queues.setdefault(t.executor, []).append(t)
        self.inflight_bytes += t.size
        return t

    def _forget(self, t: CopyTask) -> None:
        self.tasks.pop(t.id, None)
        if self._by_key.get(t.key) is t:
            del self._by_key[t.key]
        q = self._queues.get(t.executor)
        if q is not None and t in q:
            q.remove(t)
            if not q:
                del self._queues[t.executor]
        self.inflight_bytes -= t.size

    @staticmethod
    def _free_dst(d: Directory, t: CopyTask) -> None:
        d.segtab.free((t.dst, t.dst_off), t.size)

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
        t = self._by_key.get(key)
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
        if self._active_replica(d, obj, _FILE) is not None:
            return False  # already on disk: just free the memory replica
        if key in self._failed:
            del self._failed[key]
            return False
        src = self._active_replica(d, obj, _MEM, live_owner=True)
        if src is None or not self._budget_ok(obj.size):
            return False
        out: list[Any] = []
        pref = self._same_host(d, _FILE, src[0].desc.host_id)
        if not d.placement.place(obj.size, 1, _FILE, pref, out):
            self.counters["offload_no_space"] += 1
            return False
        if d.objects.get(key) is not obj:  # making room on disk removed it
            d.segtab.free(tuple(out), obj.size)
            return True
        self._new_task(TaskKind.OFFLOAD, key, obj, src, (out[0], out[1]))
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
        picked: list[tuple[str, Obj]] = []
        want = 0
        # collect first: allocating disk space may evict (mutate the table)
        for i, (key, obj) in enumerate(d.objects.lru_items()):
            if i >= max_scan or want >= budget:
                break
            if key in self._by_key or obj.flags & HARD_PIN or key in self._failed:
                continue
            if self._active_replica(d, obj, _FILE) is not None:
                continue
            picked.append((key, obj))
            want += obj.size
        queued = 0
        for key, obj in picked:
            if d.objects.get(key) is not obj or not self._budget_ok(obj.size):
                continue
            src = self._active_replica(d, obj, _MEM, live_owner=True)
            if src is None:
                continue
            out: list[Any] = []
            pref = self._same_host(d, _FILE, src[0].desc.host_id)
            if not d.placement.place(obj.size, 1, _FILE, pref, out):
                self.counters["offload_no_space"] += 1
                break
            if d.objects.get(key) is not obj:
                d.segtab.free(tuple(out), obj.size)
                continue
            self._new_task(TaskKind.COPY, key, obj, src, (out[0], out[1]))
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
        if not self.cfg.promote_on_hit or key in self._by_key or not d.pools[_MEM]:
            return
        for i in range(0, len(reps), 2):
            if reps[i].kind != _FILE:
                return
        if not self._hit_enough(key):
            return
        src = self._active_replica(d, obj, _FILE, live_owner=True)
        if src is None or not self._budget_ok(obj.size):
            return
        out: list[Any] = []
        pref = self._same_host(d, _MEM, src[0].desc.host_id)
        if not d.placement.place(obj.size, 1, _MEM, pref, out):
            return
        if d.objects.get(key) is not obj:
            d.segtab.free(tuple(out), obj.size)
            return
        self._new_task(TaskKind.PROMOTE, key, obj, src, (out[0], out[1]))
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
        q = self._queues.get(client_id)
        if not q:
            return [], {}
        out: list[dict[str, Any]] = []
        segs: dict[str, Any] = {}
        now = self.clock()
        ttl = self.cfg.task_timeout_s
        for t in q:
            if t.sent:
                continue
            t.sent = True
            # the node gets the whole timeout from now; it never starts a copy
            # after half of it (its clock: "ttl_ms" is relative), so nothing
            # lands in the destination after the master gave up and freed it
            t.deadline = now + ttl
            if t.job is not None and t.job.status == JobStatus.PENDING:
                t.job.status = JobStatus.PROCESSING
                t.job.updated_ms = time.time_ns() // 1_000_000
            w = t.to_wire()
            w["ttl_ms"] = int(ttl * 1000)
            out.append(w)
            segs[t.src.id] = t.src.wire
            segs[t.dst.id] = t.dst.wire
            if len(out) >= self.cfg.max_tasks_per_ping:
                break
        return out, segs

    def complete(self, d: Directory, client_id: str, task_id: int, ok: bool,
                 error: str = "") -> ErrorCode:
        """A node reports a task. Applies the replica change on success (and
        journals it); frees the destination on failure. Returns OK, or
        OBJECT_NOT_FOUND for an unknown/expired task, INVALID_WRITE when
        ``client_id`` is not its executor."""
        t = self.tasks.get(task_id)
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
        self._forget(t)
        t.dst.keys.add(t.key)
        if t.job is not None:
            obj.replicas = (*reps, t.dst, t.dst_off)
            if t.kind is TaskKind.REPLICA_MOVE:
                self._drop_source(d, t.key, obj, t.src, t.src_off)
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
        self._journal_replicas(d, t.key, obj)
        return ErrorCode.OK

    def _cancel(self, d: Directory, t: CopyTask, why: str) -> None:
        """Detach a task from its key. A task already handed out keeps its
        destination allocated until the node reports or the deadline passes
        (a late copy must not land in reused space); an unsent one is failed."""
        if not t.sent:
            self._fail(d, t, why, count=False)
            return
        t.cancelled = True
        if self._by_key.get(t.key) is t:
            del self._by_key[t.key]

    def _fail(self, d: Directory, t: CopyTask, why: str, count: bool = True) -> None:
        self._forget(t)
        self._free_dst(d, t)
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
        dead = [t for t in self.tasks.values()
                if t.deadline < now or t.executor not in d.clients]
        for t in dead:
            self.counters["tasks_expired"] += 1
            self._fail(d, t, "timed out" if t.deadline < now else "executor gone")
        return len(dead)

    # ---------------------------------------------------------------- replica jobs
    @staticmethod
    def _drop_source(d: Directory, key: str, obj: Obj, src: Segment, src_off: int) -> None:
        """A move's last step: the source replica leaves ``obj``; its space is
        freed once the object's read lease has ended (a reader may be copying)."""
        reps = obj.replicas
        kept: list[Any] = []
        for i in range(0, len(reps), 2):
            if not (reps[i] is src and reps[i + 1] == src_off):
                kept += (reps[i], reps[i + 1])
        obj.replicas = tuple(kept)
        src.keys.discard(key)
        d.writes.hold((src, src_off), obj.size, max(obj.lease, d.objects.lease_grace_until))

    def _job(self, key: str, move: bool, executor: str) -> ReplicaJob:
        now_ms = time.time_ns() // 1_000_000
        job = ReplicaJob(next(self._job_ids), move, key, executor, now_ms, now_ms)
        self.jobs[job.id] = job
        if len(self.jobs) > _JOB_MEMORY:
            del self.jobs[next(iter(self.jobs))]
        return job

    def create_job(self, d: Directory, key: str, targets: list[str],
                   source: str = "") -> tuple[ErrorCode, ReplicaJob | None]:
        """Start a replica job: copy ``key`` onto every segment of ``targets``
        (``source`` ""), or move its replica on ``source`` to ``targets[0]``.

        OBJECT_NOT_FOUND: no such complete object; INVALID_PARAMS: no target,
        a target or source that is not an active segment, a move whose source
        holds no replica of the object or equals its target;
        OBJECT_HAS_REPLICATION_TASK: a tier task is copying the object now;
        REPLICA_IS_NOT_READY: no replica whose owner is alive to copy from;
        NO_AVAILABLE_HANDLE: a target has no room even after eviction. Targets
        that already hold a replica are skipped (a job with nothing left to
        copy succeeds at once; so does a move onto a segment that has one:
        the source replica is just dropped). Changes made at once are journaled."""
        obj = d.objects.get(key)
        if obj is None:
            return ErrorCode.OBJECT_NOT_FOUND, None
        want: list[Segment] = []
        for sid in targets:
            seg = d.segments.get(sid)
            if not sid or seg is None or seg.state != SegState.ACTIVE:
                return ErrorCode.INVALID_PARAMS, None
            if seg not in want:
                want.append(seg)
        if not want or (source and len(want) != 1):
            return ErrorCode.INVALID_PARAMS, None
        reps = obj.replicas
        holders = {reps[i].id: (reps[i], reps[i + 1]) for i in range(0, len(reps), 2)
                   if reps[i].state == SegState.ACTIVE}
        if source:
            if source == want[0].id or source not in holders:
                return ErrorCode.INVALID_PARAMS, None
            src: tuple[Segment, int] | None = holders[source]
        else:
            src = self._active_replica(d, obj, _MEM, live_owner=True) \
                or self._active_replica(d, obj, _FILE, live_owner=True)
        if src is None or src[0].owner not in d.clients:
            return ErrorCode.REPLICA_IS_NOT_READY, None
        running = self._by_key.get(key)
        if running is not None and running.obj is obj:
            return ErrorCode.OBJECT_HAS_REPLICATION_TASK, None
        todo = [seg for seg in want if seg.id not in holders]
        job = self._job(key, bool(source), src[0].owner)
        if not todo:
            if source:  # the target holds a replica already: drop the source's
                self._drop_source(d, key, obj, src[0], src[1])
                self._journal_replicas(d, key, obj)
            job.status = JobStatus.SUCCESS
            return ErrorCode.OK, job
        placed: list[tuple[Segment, int]] = []
        for seg in todo:
            off = d.placement.allocate_on(seg, obj.size)
            if off < 0 or d.objects.get(key) is not obj:  # room-making evicted the object
                if off >= 0:
                    placed.append((seg, off))
                for s, o in placed:
                    d.segtab.free((s, o), obj.size)
                del self.jobs[job.id]
                return (ErrorCode.NO_AVAILABLE_HANDLE if off < 0
                        else ErrorCode.OBJECT_NOT_FOUND), None
            placed.append((seg, off))
        kind = TaskKind.REPLICA_MOVE if source else TaskKind.REPLICA_COPY
        for dst in placed:
            t = self._new_task(kind, key, obj, src, dst)
            t.job = job
        job.left = len(placed)
        self.counters["replica_jobs"] += 1
        return ErrorCode.OK, job

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
        for t in [t for t in self.tasks.values() if t.src is seg or t.dst is seg]:
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
            for t in [t for t in self.tasks.values() if t.src is seg or t.dst is seg]:
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
        return {**self.counters, "tier_tasks_inflight": len(self.tasks),
                "tier_inflight_bytes": self.inflight_bytes,
                "file_segments_awaiting": len(self.file_awaiting)}
