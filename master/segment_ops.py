"""The handlers of the segment and liveness ops, and of the tier tasks nodes
run: PING (with the copy tasks it hands out), MOUNT_SEGMENT,
UNMOUNT_SEGMENT, GET_SEGMENTS, LIST_SEGMENTS, TIER_TASK_DONE, and the
replica jobs (CREATE_COPY_TASK, CREATE_MOVE_TASK, QUERY_TASK).

A mount hands out the segment's capability key (persisted before the reply:
``ServerInfo.save_keys``); a re-adoption after a master restart keeps it, so
grants made before the restart stay valid.
"""

from __future__ import annotations

from kvpool.core.capability import CapOp
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    CreateCopyTask,
    CreateMoveTask,
    Empty,
    GetSegments,
    GetSegmentsReply,
    ListSegments,
    ListSegmentsReply,
    MountSegment,
    MountSegmentReply,
    Ping,
    PingReply,
    QueryTask,
    QueryTaskReply,
    SegmentDescriptor,
    SegmentInfo,
    TaskReply,
    TierTask,
    TierTaskDone,
    UnmountSegment,
)
from kvpool.master.directory import SegState
from kvpool.master.grants import Grants
from kvpool.master.keys import check_key
from kvpool.master.op_group import OpGroup, bad

__all__ = ["SegmentOps"]

_CAP_WRITE = int(CapOp.WRITE)


class SegmentOps(OpGroup):
    """Segments, client liveness and the tier tasks."""

    def ping(self, req: Ping) -> PingReply:
        client_id = self.check_client(req.client_id)
        d = self.dir
        if req.heartbeat:
            # from the client's guard process: its memory lives (it may be stalled)
            return PingReply(False, known=d.liveness.heartbeat(client_id))
        remount, ids = d.liveness.ping(client_id)
        out = PingReply(remount, ids)
        if self.signer is not None and self.signer.epoch:
            out.epoch = self.signer.epoch  # the term this master signs in (HA fencing)
        parked = self.info.parked
        if parked is not None and not req.wait_ms:
            parked.release(client_id)  # a ping that does not wait answers a held one
        if self.tiering.tasks:  # SSD tier: copy tasks this node executes
            wires, _segs = self.tiering.tasks_for(d, client_id)
            if wires:
                grants = Grants(self.signer, _CAP_WRITE, self._task_expiry())
                segs: dict[str, SegmentDescriptor] = {}
                tasks = []
                for w in wires:
                    (src_id, src_off), (dst_id, dst_off) = w["src"], w["dst"]
                    for sid in (src_id, dst_id):
                        seg = d.segments.get(sid)
                        if seg is not None:
                            segs[sid] = seg.desc
                    tasks.append(TierTask(w["id"], w["kind"], w["key"], w["size"], src_id,
                                          src_off, dst_id, dst_off, int(w.get("ttl_ms", 0)),
                                          grants.slot(dst_id, dst_off, w["size"])))
                out.tasks = tasks
                out.segments = segs
                out.caps = grants.sign()
                return out
        if req.wait_ms and not remount and parked is not None:
            parked.ask(client_id, req.wait_ms)  # held when the loop allows it
        return out

    def _task_expiry(self) -> int:
        signer = self.signer
        if signer is None:
            return 0
        return signer.expiry(max(signer.ttl_ms, int(self.cfg.tiering.task_timeout_s * 1000)))

    def mount_segment(self, req: MountSegment) -> MountSegmentReply:
        client_id = self.check_client(req.client_id)
        desc = req.segment
        if desc.size <= 0 or desc.size > 1 << 50:
            raise bad("segment size out of range")
        signer = self.signer
        prev = self.dir.segments.get(desc.segment_id)
        # re-adoption after a master restart keeps the persisted key (grants
        # made before the restart stay valid); every other mount gets a new one
        keep = (signer is not None and prev is not None and prev.state == SegState.AWAITING
                and signer.has_key(desc.segment_id))
        self.dir.mount(client_id, desc)
        if signer is None:
            return MountSegmentReply()
        if keep:
            key = signer.key_for(desc.segment_id)
        else:
            key = signer.rotate(desc.segment_id)
            self.info.save_keys()  # durable before the reply hands the key out
        return MountSegmentReply(key)

    def unmount_segment(self, req: UnmountSegment) -> Empty:
        if not req.segment_id:
            raise bad("segment_id must be a non-empty string")
        self.dir.unmount(self.check_client(req.client_id), req.segment_id)
        return Empty()

    def get_segments(self, req: GetSegments) -> GetSegmentsReply:
        self.check_batch(req.segment_ids)
        segs = self.dir.segments
        active = SegState.ACTIVE
        out = {}
        for i in req.segment_ids:
            seg = segs.get(i)
            if seg is not None and seg.state == active:
                out[i] = seg.desc
        return GetSegmentsReply(out)

    def list_segments(self, req: ListSegments | None = None) -> ListSegmentsReply:
        return ListSegmentsReply([
            SegmentInfo(seg.desc, seg.alloc.used, seg.alloc.capacity,
                        round(seg.alloc.fragmentation(), 4), seg.alloc.free_blocks,
                        len(seg.keys), seg.state.name.lower())
            for seg in list(self.dir.segments.values())])

    # ================================================================ tier tasks
    def tier_task_done(self, req: TierTaskDone) -> Empty:
        self.fail(self.tiering.complete(self.dir, self.check_client(req.client_id),
                                        req.task_id, req.ok, req.error[:500]), "tier_task_done")
        return Empty()

    def _task(self, key: str, targets: list[str], source: str, tenant: str) -> TaskReply:
        s = self.scope(tenant)
        check_key(key, self.max_key)
        if len(targets) > 64:
            raise bad("at most 64 targets")
        code, job = self.tiering.create_job(self.dir, s.prefix + key, targets, source)
        self.count_one("create_task")
        self.fail(code, "create task failed")
        assert job is not None
        return TaskReply(job.id)

    def create_copy_task(self, req: CreateCopyTask) -> TaskReply:
        return self._task(req.key, req.targets, "", req.tenant)

    def create_move_task(self, req: CreateMoveTask) -> TaskReply:
        if not req.source:
            raise bad("source must be a segment id")
        return self._task(req.key, [req.target], req.source, req.tenant)

    def query_task(self, req: QueryTask) -> QueryTaskReply:
        s = self.scope(req.tenant)
        job = self.tiering.jobs.get(req.task_id)
        if job is None or not s.owns(job.key):  # another tenant's task is none of its business
            raise bad(f"no task {req.task_id}", ErrorCode.TASK_NOT_FOUND)
        return QueryTaskReply(job.id, job.move, s.user_key(job.key), int(job.status),
                              job.created_ms,
                              job.updated_ms, job.executor, job.message)
