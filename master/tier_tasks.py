"""The SSD tier's copies: tier tasks in flight, and the replica jobs made of them.

The master never touches payload bytes, so every copy between tiers is a
**tier task** executed by the node that owns the source replica (it has the
bytes locally): the master hands tasks out in PING replies, the node copies
with its transfer engine and reports with ``TIER_TASK_DONE``. The
:class:`TaskBook` holds the tasks in flight (by id, by key, per executor)
and the bytes they copy. A **replica job** (:class:`ReplicaJobs`:
Mooncake's copy/move tasks, ``CREATE_COPY_TASK`` / ``CREATE_MOVE_TASK`` /
``QUERY_TASK``) copies an object's replica onto named segments, or moves it
from one segment to another, as one tier task per destination; finished
jobs are remembered (the newest ``_JOB_MEMORY``) for QUERY_TASK, not
journaled. What a finished task changes is the policy's
(:meth:`kvpool.master.tiering.TieringPolicy.complete`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.master.objects import Obj
from kvpool.master.segments import Segment, SegState
from kvpool.master.tiering_config import TieringConfig

if TYPE_CHECKING:
    from kvpool.master.directory import Directory

__all__ = ["CopyTask", "JobStatus", "ReplicaJob", "ReplicaJobs", "TaskBook", "TaskKind",
           "active_replica"]

_MEM = SegmentKind.MEMORY
_FILE = SegmentKind.FILE
_ACTIVE = SegState.ACTIVE
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


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


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
        self.updated_ms = _now_ms()
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


def active_replica(d: Directory, obj: Obj, kind: SegmentKind,
                   live_owner: bool = False) -> tuple[Segment, int] | None:
    """``obj``'s first replica on an ACTIVE segment of ``kind`` (whose owner
    the directory knows, with ``live_owner``): (segment, offset), or None."""
    reps = obj.replicas
    for i in range(0, len(reps), 2):
        seg = reps[i]
        if seg.kind == kind and seg.state == _ACTIVE \
                and (not live_owner or seg.owner in d.clients):
            return seg, reps[i + 1]
    return None


class TaskBook:
    """The tier tasks in flight: by id, by key (one per object), queued per
    executor until handed out, and the bytes they copy."""

    def __init__(self, cfg: TieringConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.clock = clock
        self._ids = itertools.count(1)
        self.tasks: dict[int, CopyTask] = {}
        self.by_key: dict[str, CopyTask] = {}
        self._queues: dict[str, list[CopyTask]] = {}
        self.inflight_bytes = 0
        #: told the executor of each task queued (the master's held PINGs)
        self.on_queued: Callable[[str], None] = lambda client_id: None

    def budget_ok(self, size: int) -> bool:
        """Whether a copy of ``size`` more bytes fits ``max_inflight_bytes``."""
        cap = self.cfg.max_inflight_bytes
        return not cap or self.inflight_bytes + size <= cap

    def new(self, kind: TaskKind, key: str, obj: Obj, src: tuple[Segment, int],
            dst: tuple[Segment, int]) -> CopyTask:
        """Queue a copy of ``obj`` from ``src`` to ``dst`` (allocated) for the
        source's owner."""
        t = CopyTask(next(self._ids), kind, key, obj, obj.size, src[0], src[1], dst[0], dst[1],
                     src[0].owner, self.clock() + self.cfg.task_timeout_s)
        self.tasks[t.id] = t
        self.by_key[key] = t
        self._queues.setdefault(t.executor, []).append(t)
        self.inflight_bytes += t.size
        self.on_queued(t.executor)
        return t

    def forget(self, t: CopyTask) -> None:
        """``t`` is over (its destination is the caller's to keep or free)."""
        self.tasks.pop(t.id, None)
        if self.by_key.get(t.key) is t:
            del self.by_key[t.key]
        q = self._queues.get(t.executor)
        if q is not None and t in q:
            q.remove(t)
            if not q:
                del self._queues[t.executor]
        self.inflight_bytes -= t.size

    def hand_out(self, client_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(task wires, {segment_id: descriptor wire}) for ``client_id``'s PING
        reply; each task is handed out once, at most ``max_tasks_per_ping``."""
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
                t.job.updated_ms = _now_ms()
            w = t.to_wire()
            w["ttl_ms"] = int(ttl * 1000)
            out.append(w)
            segs[t.src.id] = t.src.wire
            segs[t.dst.id] = t.dst.wire
            if len(out) >= self.cfg.max_tasks_per_ping:
                break
        return out, segs

    def of_segment(self, seg: Segment) -> list[CopyTask]:
        """The tasks that copy from or to ``seg``."""
        return [t for t in self.tasks.values() if t.src is seg or t.dst is seg]


class ReplicaJobs:
    """Replica jobs (see the module docstring), their tasks in ``book``."""

    def __init__(self, book: TaskBook) -> None:
        self.book = book
        self.jobs: dict[int, ReplicaJob] = {}  # oldest first (bounded)
        self._ids = itertools.count(1)

    @staticmethod
    def drop_source(d: Directory, key: str, obj: Obj, src: Segment, src_off: int) -> None:
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
        now_ms = _now_ms()
        job = ReplicaJob(next(self._ids), move, key, executor, now_ms, now_ms)
        self.jobs[job.id] = job
        if len(self.jobs) > _JOB_MEMORY:
            del self.jobs[next(iter(self.jobs))]
        return job

    def create(self, d: Directory, key: str, targets: list[str],
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
        the source replica is just dropped). Changes made at once are recorded."""
        obj = d.objects.get(key)
        if obj is None:
            return ErrorCode.OBJECT_NOT_FOUND, None
        want: list[Segment] = []
        for sid in targets:
            seg = d.segments.get(sid)
            if not sid or seg is None or seg.state != _ACTIVE:
                return ErrorCode.INVALID_PARAMS, None
            if seg not in want:
                want.append(seg)
        if not want or (source and len(want) != 1):
            return ErrorCode.INVALID_PARAMS, None
        reps = obj.replicas
        holders = {reps[i].id: (reps[i], reps[i + 1]) for i in range(0, len(reps), 2)
                   if reps[i].state == _ACTIVE}
        if source:
            if source == want[0].id or source not in holders:
                return ErrorCode.INVALID_PARAMS, None
            src: tuple[Segment, int] | None = holders[source]
        else:
            src = active_replica(d, obj, _MEM, live_owner=True) \
                or active_replica(d, obj, _FILE, live_owner=True)
        if src is None or src[0].owner not in d.clients:
            return ErrorCode.REPLICA_IS_NOT_READY, None
        running = self.book.by_key.get(key)
        if running is not None and running.obj is obj:
            return ErrorCode.OBJECT_HAS_REPLICATION_TASK, None
        todo = [seg for seg in want if seg.id not in holders]
        job = self._job(key, bool(source), src[0].owner)
        if not todo:
            if source:  # the target holds a replica already: drop the source's
                before = obj.replicas
                self.drop_source(d, key, obj, src[0], src[1])
                if key < " " or d.tenants.track_default:
                    d.tenants.rereps(key, obj.size, before, obj.replicas)
                if d.journaling:
                    d.records.append(d.objects.put_record(key, obj))
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
            t = self.book.new(kind, key, obj, src, dst)
            t.job = job
        job.left = len(placed)
        return ErrorCode.OK, job
