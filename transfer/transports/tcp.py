"""``tcp``: any host, through the segment owner's transfer server.

:meth:`TcpTransport.execute` runs in named steps: :meth:`~TcpTransport._route`
sorts a sub-batch into what the peers' bulk sockets can take and the rest;
:meth:`~TcpTransport._run_bulk` moves the first (:mod:`kvpool.transfer.bulk`:
plain TCP, in place, many ranges per round trip; one thread per extra peer so
a silent peer does not hold up a live one); :class:`~.tcp_zmq.ZmqRun` moves
the rest over ZeroMQ (GPU buffers, peers with CURVE or without a bulk socket,
the first requests to a peer whose descriptor does not publish its bulk port,
while it is being asked). A lone request below the striping size, or a
sub-batch of host-buffer requests that all name one segment (the pages of a KV
batch), to a peer whose bulk port is known skips the steps and goes straight
over one idle bulk connection (:meth:`~TcpTransport._execute_direct`).

What is known of the peers' bulk sockets and the connections to them:
:mod:`kvpool.transfer.transports.tcp_bulk`; the ZeroMQ sockets and path:
:mod:`kvpool.transfer.transports.tcp_zmq`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpool.core.config import parse_size
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.bulk_client import BulkClient
from kvpool.transfer.gpu import CudaRuntime, PinnedPool, cuda_runtime
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem, report_done
from kvpool.transfer.transports.tcp_bulk import BulkHelpers, BulkPeer, BulkPeers
from kvpool.transfer.transports.tcp_zmq import FINAL_CODES, ZmqRun, ZmqSockets
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

# a lone request of at least two stripes goes over several connections at once, in
# stripes of at least this much (transports.tcp.options.stripe_bytes; smaller ones
# measured slower on a 16-core host: a 16 MiB get over 8 stripes ran at 0.88x of 4;
# docs/bench/xhost31_threads_h200_*.json)
DEFAULT_STRIPE_BYTES = 4 << 20


class TcpTransport(Transport):
    """Chunked, pipelined READ/WRITE through peers' transfer servers."""

    name = "tcp"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)  # ZeroMQ request ids
        self._pool: PinnedPool | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bulk_requests = 0
        #: the ZeroMQ sockets (per-thread connections, bulk-port queries)
        self.zmq = ZmqSockets(self.curve)
        self._socks = self.zmq.socks  # every ZeroMQ socket open now
        #: the peers' bulk ports and the idle connections to them
        self.bulk_peers = BulkPeers(self)
        self._helpers = BulkHelpers()
        self.stripe_bytes = max(64 << 10, parse_size(self.settings.options.get(
            "stripe_bytes", DEFAULT_STRIPE_BYTES), binary_units=True))

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return device == "cpu" or cuda_runtime()[0] is not None

    def curve(self) -> Any:
        """The engine's CURVE policy towards peers' transfer servers (None: plain)."""
        return getattr(self.ctx, "curve", None)

    def _staging(self) -> tuple[CudaRuntime, PinnedPool]:
        rt, reason = cuda_runtime()
        if rt is None:
            raise TransferError(reason, ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
        with self._lock:
            if self._pool is None:
                self._pool = PinnedPool(rt, self.settings.staging_buffers,
                                        self.settings.staging_bytes)
            return rt, self._pool

    def warm_gpu(self, segment: SegmentDescriptor, local: LocalSegment | None,
                 same_host: bool) -> None:
        """Page-lock the GPU staging pool before the first GPU request to another host."""
        if not same_host and not self.closed and cuda_runtime()[0] is not None:
            self._staging()

    # -- step 1: route ---------------------------------------------------------------
    def _route(self, items: Sequence[WorkItem], report: ReportFn
               ) -> tuple[dict[str, list[WorkItem]], list[WorkItem]]:
        """Items for each peer's bulk socket (by endpoint), and the rest (ZeroMQ).
        Items whose segment names no endpoint are failed here."""
        bulk_on = bool(self.settings.options.get("bulk", True))
        by_ep: dict[str, list[WorkItem]] = {}
        rest: list[WorkItem] = []
        peers: dict[str, BulkPeer] = {}  # asked once per endpoint per sub-batch
        # the items of a sub-batch mostly share one segment (descriptor object):
        # what its endpoint gets is worked out once per run of it
        last_seg: SegmentDescriptor | None = None
        ep = ""
        peer: BulkPeer | None = None
        bulk_list: list[WorkItem] | None = None
        for it in items:
            seg = it.segment
            if seg is not last_seg:
                last_seg, ep, peer, bulk_list = seg, seg.endpoint, None, None
                if ep and bulk_on and seg.kind == SegmentKind.MEMORY:
                    peer = peers.get(ep)
                    if peer is None:
                        peer = peers[ep] = self.bulk_peers.peer(ep, seg)
                    if peer.port > 0:
                        bulk_list = by_ep.setdefault(ep, [])
            if not ep:
                report(it, TransferError(f"segment {seg.segment_id} has no endpoint",
                                         ErrorCode.TRANSPORT_UNAVAILABLE))
                continue
            if bulk_list is not None and peer is not None and it.length <= peer.max_bytes \
                    and it.buffer.device != "cuda":
                bulk_list.append(it)
                continue
            rest.append(it)
        return {k: v for k, v in by_ep.items() if v}, rest

    # -- step 2: the bulk sockets -------------------------------------------------------
    def _run_bulk(self, by_ep: dict[str, list[WorkItem]], deadline: float,
                  report: ReportFn) -> list[WorkItem]:
        """Move each peer's items over its bulk socket (a lone large item over
        several, see :meth:`_stripes`); return the items of peers that could
        not be connected (they go over ZeroMQ)."""
        rest: list[WorkItem] = []
        jobs: list[tuple[str, list[WorkItem], BulkClient]] = []
        parts: dict[int, list[Any]] = {}  # id(sub-item) -> [whole item, its state]
        for ep, its in by_ep.items():
            stripes = self._stripes(its, parts)
            clients = [self.bulk_peers.checkout(ep, deadline) for _ in stripes]
            if any(bc is None for bc in clients):
                for bc in clients:
                    if bc is not None:
                        self.bulk_peers.checkin(ep, bc)
                rest.extend(its)
                continue
            jobs += [(ep, part, bc) for part, bc in zip(stripes, clients, strict=True)
                     if bc is not None]
        lock = threading.Lock()

        rep_whole = self._counted(report)  # reports a whole item (and counts its bytes)

        def rep(it: WorkItem, err: TransferError | None) -> None:
            whole = parts.get(id(it)) if parts else None
            if whole is not None:  # a stripe of a larger item: report the item once
                with lock:
                    state = whole[1]
                    if state["reported"]:
                        return
                    state["left"] -= 1
                    if err is None and state["left"] > 0:
                        return
                    state["reported"] = True
                it = whole[0]
            rep_whole(it, err)

        def run(ep: str, its: list[WorkItem], bc: BulkClient) -> None:
            try:
                bc.run(its, deadline, rep if parts else rep_whole, FINAL_CODES,
                       time.monotonic)
            finally:
                self.bulk_requests += len(its)
                self.bulk_peers.checkin(ep, bc)

        if parts:
            # the stripes of a lone READ: every request out first, so the peer
            # serves them all at once, whenever each receiving thread gets to run
            for _ep, part, bc in jobs:
                if len(part) == 1 and part[0].op is TransferOp.READ and id(part[0]) in parts:
                    bc.send_ahead(part[0], deadline)
        # one thread per extra connection: a silent peer must not hold up a live one,
        # and the stripes of a large item move in parallel
        waits = [self._helpers.submit(run, job) for job in jobs[1:]]
        if jobs:
            run(*jobs[0])
        # every job's socket waits end at the deadline; returning before a job
        # ends would let its stripe write into a buffer the caller moved on from
        for done in waits:
            if not done.wait(max(0.0, deadline - time.monotonic()) + 1.0):
                log.warning("tcp: a bulk job still runs 1s after its deadline; waiting for it")
                done.wait()
        return rest

    def _counted(self, report: ReportFn) -> ReportFn:
        """``report`` of whole items that also counts their bytes as sent or
        received (with the ``many`` form for a run of successes of one op)."""

        def rep(it: WorkItem, err: TransferError | None) -> None:
            if err is None:
                if it.op is TransferOp.READ:
                    self.bytes_received += it.length
                else:
                    self.bytes_sent += it.length
            report(it, err)

        def rep_many(its: Sequence[WorkItem]) -> None:  # successes of one op
            n = sum(it.length for it in its)
            if its and its[0].op is TransferOp.READ:
                self.bytes_received += n
            else:
                self.bytes_sent += n
            report_done(report, its)

        rep.many = rep_many  # type: ignore[attr-defined]  # see base.report_done
        return rep

    def _stripes(self, items: list[WorkItem], parts: dict[int, list[Any]]
                 ) -> list[list[WorkItem]]:
        """``items`` as one list, or, for a lone item of at least two
        ``stripe_bytes``, as ``threads`` stripes of it, each to go over its own connection
        (one TCP stream of one thread is slower than the link: docs/BENCHMARKS.md).
        ``parts`` maps each stripe
        to the whole item."""
        if len(items) != 1 or items[0].length < 2 * self.stripe_bytes:
            return [items]
        it = items[0]
        n = min(int(self.settings.threads), it.length // self.stripe_bytes)
        if n < 2:
            return [items]
        step = -(-it.length // n) + 4095 & ~4095  # page-aligned stripes
        state: dict[str, Any] = {"left": 0, "reported": False}
        out = []
        for off in range(0, it.length, step):
            sub = msgspec.structs.replace(it, offset=it.offset + off,
                                      buffer_offset=it.buffer_offset + off,
                                      length=min(step, it.length - off))
            parts[id(sub)] = [it, state]
            state["left"] += 1
            out.append([sub])
        return out

    # -- execute ------------------------------------------------------------------------
    def _execute_direct(self, items: Sequence[WorkItem], deadline: float,
                        report: ReportFn) -> bool:
        """Small requests that all name one segment (a lone request, or the
        pages of a KV batch) to a peer whose bulk port is known, over one idle
        bulk connection, without the routing and fan-out steps of a sub-batch
        (they cost a single small put or get much of its client CPU). False,
        having done nothing, where that does not apply: the
        general steps then serve them."""
        it0 = items[0]
        seg = it0.segment
        ep = seg.endpoint
        peers = self.bulk_peers
        peer = peers.known.get(ep) if ep else None
        if peer is None and ep and "bulk" in seg.extra:  # first met: its descriptor's word
            peer = peers.peer(ep, seg)
        if peer is None or peer.port <= 0 or seg.kind != SegmentKind.MEMORY \
                or not self.settings.options.get("bulk", True):
            return False
        max_bytes = peer.max_bytes
        if len(items) == 1:
            if it0.length > max_bytes or it0.buffer.device == "cuda" \
                    or (it0.length >= 2 * self.stripe_bytes
                        and int(self.settings.threads) > 1):
                return False
        else:  # (one list of several items is never striped)
            for it in items:
                if it.segment is not seg or it.length > max_bytes \
                        or it.buffer.device == "cuda":
                    return False
        bc = peers.checkout(ep, deadline)
        if bc is None:  # the peer is marked as having no bulk port: ZeroMQ serves them
            return False

        try:
            bc.run(items, deadline, self._counted(report), FINAL_CODES, time.monotonic)
        finally:
            self.bulk_requests += len(items)
            self.bulk_peers.checkin(ep, bc)
        return True

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        if items and self._execute_direct(items, deadline, report):
            return
        by_ep, rest = self._route(items, report)
        if by_ep:
            rest += self._run_bulk(by_ep, deadline, report)
        if rest:
            ZmqRun(self, rest, deadline, report).run()

    def stats(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "bulk_requests": self.bulk_requests}

    def close(self) -> None:
        super().close()
        self._helpers.close()
        self.bulk_peers.close()
        self.zmq.close()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
