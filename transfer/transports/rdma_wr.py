"""The data path of the ``rdma`` transport: requests planned into work
requests, posted over a peer's queue pairs and completed.

A sub-batch is planned into WRs (:func:`plan_work_requests`): requests split
at ``max_wr_bytes``, adjacent requests whose remote ranges are contiguous
gathered into one WR with up to ``max_sge`` SGEs. WRs are posted round-robin
over the peer's QPs, at most ``qp_depth`` in flight per QP, all signalled,
and the executing worker polls the CQ (:class:`WrRun`). A completion error
(:func:`completion_error`) fails the requests of that WR with a retryable
``TransferError`` (the engine fails them over to tcp), moves the connection's
QPs to ERR so the rest flush, and drops the connection; the next sub-batch
reconnects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.core.errors import ErrorCode
from kvpool.transfer.rdma_verbs import Completion, Sge, VerbsError, WcStatus, WorkRequest, WrOp
from kvpool.transfer.transports.base import ReportFn, WorkItem
from kvpool.transfer.transports.rdma_connect import Connection, PeerState, RdmaConnector
from kvpool.transfer.transports.rdma_memory import Staging
from kvpool.transfer.types import TransferError, TransferOp

if TYPE_CHECKING:
    from kvpool.transfer.transports.rdma import RdmaTransport

__all__ = [
    "PlannedSge",
    "PlannedWr",
    "WrPiece",
    "WrRun",
    "completion_error",
    "plan_work_requests",
]

log = logging.getLogger(__name__)

_POLL_BATCH = 64


@dataclass(frozen=True, slots=True)
class WrPiece:
    """One request as the planner sees it. ``local_addr``/``lkey`` are 0 for a
    staged request (its SGEs get a staging buffer at post time)."""

    key: int
    op: TransferOp
    remote_addr: int
    rkey: int
    length: int
    local_addr: int = 0
    lkey: int = 0
    staged: bool = False


@dataclass(frozen=True, slots=True)
class PlannedSge:
    """``length`` bytes at ``offset`` of request ``key`` (``addr`` = local address,
    0 when staged)."""

    key: int
    offset: int
    length: int
    addr: int
    lkey: int


@dataclass(slots=True)
class PlannedWr:
    """One WR: ``sges`` gather/scatter ``nbytes`` <-> ``remote_addr``; ``keys``
    are the requests it carries a part of (in order)."""

    op: TransferOp
    remote_addr: int
    rkey: int
    sges: list[PlannedSge]
    staged: bool = False
    keys: list[int] = field(default_factory=list)
    nbytes: int = 0

    @property
    def length(self) -> int:
        return self.nbytes


def plan_work_requests(pieces: Sequence[WrPiece], max_wr_bytes: int, max_sge: int,
                       staged_max_bytes: int | None = None) -> list[PlannedWr]:
    """Turn requests into RDMA work requests.

    Each request is split into chunks of at most ``max_wr_bytes`` (staged ones
    at ``staged_max_bytes``, the staging buffer size). Consecutive non-staged
    chunks of the same op and rkey whose remote ranges are contiguous are
    gathered into one WR of up to ``max_wr_bytes`` bytes: a chunk that is also
    locally contiguous with the previous one (same lkey) extends its SGE, any
    other takes a new SGE, up to ``max_sge`` (e.g. KV blocks scattered in local
    memory written to one remote object). Staged chunks always get a WR of
    their own (one staging buffer each). Zero-length requests produce no WR.
    """
    if max_wr_bytes <= 0 or max_sge <= 0:
        raise ValueError("max_wr_bytes and max_sge must be > 0")
    out: list[PlannedWr] = []
    for p in pieces:
        limit = min(max_wr_bytes, staged_max_bytes or max_wr_bytes) if p.staged \
            else max_wr_bytes
        off = 0
        while off < p.length:
            n = min(limit, p.length - off)
            raddr = p.remote_addr + off
            last = out[-1] if out else None
            if (not p.staged and last is not None and not last.staged and last.op == p.op
                    and last.rkey == p.rkey and last.remote_addr + last.nbytes == raddr
                    and last.nbytes + n <= max_wr_bytes):
                prev = last.sges[-1]
                addr = p.local_addr + off
                if prev.lkey == p.lkey and prev.addr + prev.length == addr:
                    # locally contiguous too: one longer SGE (it may span requests;
                    # only staged SGEs need their key/offset, and they never merge)
                    last.sges[-1] = PlannedSge(prev.key, prev.offset, prev.length + n,
                                               prev.addr, prev.lkey)
                elif len(last.sges) < max_sge:
                    last.sges.append(PlannedSge(p.key, off, n, addr, p.lkey))
                else:
                    last = None
                if last is not None:
                    last.nbytes += n
                    if last.keys[-1] != p.key:
                        last.keys.append(p.key)
                    off += n
                    continue
            sge = PlannedSge(p.key, off, n, 0 if p.staged else p.local_addr + off,
                             0 if p.staged else p.lkey)
            out.append(PlannedWr(p.op, raddr, p.rkey, [sge], p.staged, [p.key], n))
            off += n
    return out


def completion_error(c: Completion) -> TransferError:
    """The error a failed completion gives its requests. Always retryable: a
    flushed WR, a retry-exceeded link, a stale rkey (owner re-registered) or a
    remote fault are all things another transport (tcp) may get past."""
    name = WcStatus.name_of(c.status)
    code = ErrorCode.TIMEOUT if c.status in (WcStatus.RETRY_EXC_ERR,
                                             WcStatus.RESP_TIMEOUT_ERR) \
        else ErrorCode.TRANSFER_FAIL
    extra = f", vendor_err {c.vendor_err:#x}" if c.vendor_err else ""
    return TransferError(f"completion error {name}{extra}", code, retryable=True)


@dataclass(slots=True)
class _Inflight:
    wr: PlannedWr
    qp: int
    slot: int | None


class WrRun:
    """One sub-batch to one peer over RDMA, in named steps.

    :meth:`_plan` turns the items into WRs (:func:`plan_work_requests`; an
    item without a usable registration fails at once), then :meth:`run`
    loops: :meth:`_post` posts WRs up to each QP's depth and the staging
    pool's free buffers, :meth:`_poll` takes completions (a completion error
    moves the QPs to ERR so the rest flush, and fails its requests
    retryably), :meth:`_expire` gives up at the deadline (destroying the QPs
    guarantees no late DMA into the buffers), and :meth:`_settle` reports
    what was never posted or finished. Every item is reported exactly once.
    """

    def __init__(self, rdma: RdmaTransport, peer: PeerState, conn: Connection,
                 items: list[WorkItem], deadline: float, report: ReportFn) -> None:
        self.rdma = rdma
        self.peer = peer
        self.conn = conn
        self.deadline = deadline
        self.report = report
        self.by_key: dict[int, WorkItem] = dict(enumerate(items))
        self.pending: dict[int, int] = {}  # item key -> WRs not yet completed
        self.done: set[int] = set()
        self.plan: list[PlannedWr] = []
        self.staging: Staging | None = None
        self.inflight: dict[int, _Inflight] = {}
        self.per_qp = [0] * len(conn.qps)
        self.broken: TransferError | None = None
        self.nxt = 0  # next WR of the plan to post

    def finish(self, key: int, err: TransferError | None) -> None:
        if key in self.done:
            return
        self.done.add(key)
        self.report(self.by_key[key], err)

    # -- steps ------------------------------------------------------------------------
    def _plan(self) -> None:
        pieces: list[WrPiece] = []
        for key, it in self.by_key.items():
            seg = self.conn.segments.get(it.segment.segment_id)
            if seg is None:
                self.finish(key, TransferError(f"no rdma registration for segment "
                                               f"{it.segment.segment_id!r}",
                                               ErrorCode.TRANSFER_FAIL))
                continue
            if it.offset + it.length > seg.length:
                self.finish(key, TransferError(
                    f"segment {seg.segment_id!r} registration covers {seg.length} bytes, "
                    f"request ends at {it.offset + it.length}", ErrorCode.SEGMENT_MISMATCH))
                continue
            mr = self.rdma.memory.local_mr(it.buffer)
            if mr is not None:
                pieces.append(WrPiece(key, it.op, seg.addr + it.offset, seg.rkey, it.length,
                                      it.buffer.ptr + it.buffer_offset, mr.lkey))
            else:
                pieces.append(WrPiece(key, it.op, seg.addr + it.offset, seg.rkey, it.length,
                                      staged=True))
        if any(p.staged for p in pieces):
            self.staging = self.rdma.memory.staging()
        self.plan = plan_work_requests(pieces, int(self.rdma.options.max_wr_bytes),
                                       self.conn.max_sge,
                                       self.staging.size if self.staging is not None else None)
        for pw in self.plan:
            for k in pw.keys:
                self.pending[k] = self.pending.get(k, 0) + 1

    def run(self) -> None:
        self._plan()
        idle_polls = 0
        while True:
            self._post()
            if not self.inflight:
                if self.broken is not None or self.nxt >= len(self.plan):
                    break
                # blocked on the staging pool (shared with other sub-batches)
                if time.monotonic() >= self.deadline:
                    self.broken = TransferError("rdma: no free staging buffer before the "
                                                "deadline", ErrorCode.TIMEOUT)
                    break
                time.sleep(0.0002)
                continue
            if self._poll():
                idle_polls = 0
                continue
            if self.rdma.closed or time.monotonic() >= self.deadline:
                self._expire()
                break
            idle_polls += 1
            if idle_polls > 64:
                time.sleep(0.00005)
        self._settle()

    def _post(self) -> None:
        """Post WRs while a QP has room (and, for staged WRs, a buffer is free)."""
        conn, staging, rdma = self.conn, self.staging, self.rdma
        depth = rdma.options.qp_depth
        while self.broken is None and self.nxt < len(self.plan):
            qi = min(range(len(self.per_qp)), key=self.per_qp.__getitem__)
            if self.per_qp[qi] >= depth:
                return
            pw = self.plan[self.nxt]
            slot = None
            if pw.staged:
                assert staging is not None
                slot = staging.try_acquire()
                if slot is None:
                    return
                try:
                    sges = [Sge(staging.addr(slot), pw.length, staging.mr.lkey)]
                    if pw.op == TransferOp.WRITE:
                        sg = pw.sges[0]
                        rdma.memory.stage_in(self.by_key[sg.key], sg.offset, sg.length,
                                             staging.view(slot, pw.length))
                except TransferError as exc:
                    staging.release(slot)
                    for k in pw.keys:
                        self.finish(k, exc)
                    self.nxt += 1
                    continue
            else:
                sges = [Sge(sg.addr, sg.length, sg.lkey) for sg in pw.sges]
            wr_id = next(rdma.wr_ids)
            wr = WorkRequest(wr_id, WrOp.RDMA_WRITE if pw.op == TransferOp.WRITE
                             else WrOp.RDMA_READ, sges, pw.remote_addr, pw.rkey)
            try:
                conn.qps[qi].post_send([wr])
            except VerbsError as exc:
                if slot is not None and staging is not None:
                    staging.release(slot)
                self.broken = TransferError(f"post_send: {exc}", ErrorCode.TRANSFER_FAIL)
                return
            self.inflight[wr_id] = _Inflight(pw, qi, slot)
            self.per_qp[qi] += 1
            self.nxt += 1
            rdma.counters["wrs_posted"] += 1

    def _poll(self) -> bool:
        """Handle the completions that arrived; False when none did."""
        staging, rdma = self.staging, self.rdma
        comps = self.conn.cq.poll(_POLL_BATCH)
        for c in comps:
            fl = self.inflight.pop(c.wr_id, None)
            if fl is None:
                log.warning("rdma: completion for unknown wr_id %d", c.wr_id)
                continue
            self.per_qp[fl.qp] -= 1
            err: TransferError | None = None
            if c.ok:
                rdma.counters["bytes"] += fl.wr.length
                if fl.slot is not None and fl.wr.op == TransferOp.READ and staging:
                    try:
                        sg = fl.wr.sges[0]
                        rdma.memory.stage_out(self.by_key[sg.key], sg.offset, sg.length,
                                              staging.view(fl.slot, fl.wr.length))
                    except TransferError as exc:
                        err = exc
            else:
                rdma.counters["completion_errors"] += 1
                err = completion_error(c)
                if self.broken is None:
                    self.broken = err
                    log.warning("rdma: %s on a WR to %s; failing its requests over",
                                err, self.conn.endpoint)
                    self.conn.to_error()  # flush the rest instead of waiting them out
            if fl.slot is not None and staging is not None:
                staging.release(fl.slot)
            for k in fl.wr.keys:
                if err is not None:
                    self.finish(k, err)
                else:
                    self.pending[k] -= 1
                    if self.pending[k] == 0:
                        self.finish(k, None)
        return bool(comps)

    def _expire(self) -> None:
        """The deadline passed (or the transport closed) with WRs in flight."""
        rdma = self.rdma
        rdma.counters["timeouts"] += 1
        err = TransferError(f"rdma: {len(self.inflight)} WRs to {self.conn.endpoint} not "
                            "completed by the deadline", ErrorCode.TIMEOUT) \
            if not rdma.closed else TransferError("rdma transport closed", ErrorCode.CLOSED)
        # destroying the QPs guarantees no late DMA into the buffers
        self.conn.to_error()
        RdmaConnector.drop(self.peer, self.conn)
        for fl in self.inflight.values():
            for k in fl.wr.keys:
                self.finish(k, err)
        self.inflight.clear()
        self.broken = self.broken or err

    def _settle(self) -> None:
        """Report every item not reported yet; drop a broken connection."""
        if self.broken is not None:
            for k in self.by_key:
                self.finish(k, self.broken)  # requests never posted
            RdmaConnector.drop(self.peer, self.conn)
        else:
            for k in self.by_key:
                if k not in self.done:  # e.g. a zero-length remainder
                    self.finish(k, None if self.pending.get(k, 0) == 0 else TransferError(
                        "request left unfinished", ErrorCode.TRANSFER_FAIL))
