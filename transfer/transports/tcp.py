"""``tcp``: any host, through the segment owner's transfer server.

:meth:`TcpTransport.execute` runs in named steps: :meth:`~TcpTransport._route`
sorts a sub-batch into what the peers' bulk sockets can take and the rest;
:meth:`~TcpTransport._run_bulk` moves the first (:mod:`kvpool.transfer.bulk`:
plain TCP, in place, many ranges per round trip; one thread per extra peer so
a silent peer does not hold up a live one); :class:`_ZmqRun` moves the rest
over ZeroMQ (GPU buffers, peers with CURVE or without a bulk socket, the first
requests to a peer whose descriptor does not publish its bulk port, while it is
being asked). A lone request below
the striping size, or a sub-batch of host-buffer requests that all name one
segment (the pages of a KV batch), to a peer whose bulk port is known skips
the steps and goes straight over one idle bulk connection
(:meth:`~TcpTransport._execute_direct`).

ZeroMQ path: each worker thread keeps one DEALER socket per peer endpoint. A
request is split into ``chunk_size`` chunks; up to ``window`` chunks per
connection are in flight at once, and the requests to different peers
progress in one poll loop. Frames are zero-copy: WRITE payloads are sent
straight from the caller's buffer (``copy=False``), READ payloads received
straight into it (``recv_into``). GPU buffers are staged through a pool of
pinned host buffers in both directions. A peer that stops answering fails its
requests (retryably, with TIMEOUT) at the deadline and its socket is
discarded so no stale request is delivered later. Headers:
:mod:`kvpool.transfer.wire`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer import wire
from kvpool.transfer.bulk_client import BulkClient
from kvpool.transfer.gpu import CudaRuntime, PinnedPool, cuda_runtime
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem, report_done
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

_MIN_ZERO_COPY = 64 << 10
_BULK_RETRY_S = 10.0  # how long "this peer has no bulk socket" is believed
_STRIPE_MIN = 8 << 20  # a lone request this large goes over several connections at once
_HELPER_IDLE_S = 30.0  # a bulk helper thread idle this long exits
_HELPERS_KEPT = 8  # idle bulk helper threads kept at most
# server refusals that no other attempt can fix
_FINAL_CODES = {
    ErrorCode.OUT_OF_BOUNDS, ErrorCode.PERMISSION_DENIED, ErrorCode.UNKNOWN_OP,
    ErrorCode.MALFORMED_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.INVALID_PARAMS,
    ErrorCode.SEGMENT_NOT_FOUND,
    ErrorCode.STALE_EPOCH,  # the same token stays stale: the caller asks the master again
}


@dataclass(eq=False)
class _ItemState:
    item: WorkItem
    chunks_left: int
    failed: bool = False


@dataclass(eq=False)
class _Chunk:
    st: _ItemState
    off: int  # offset inside the request
    n: int
    slot: int = -1  # pinned staging buffer (GPU buffers)


@dataclass(eq=False)
class _Conn:
    endpoint: str
    sock: zmq.Socket
    pending: deque[_Chunk] = field(default_factory=deque)
    inflight: dict[int, _Chunk] = field(default_factory=dict)
    broken: bool = False
    mon: zmq.Socket | None = None  # socket monitor: disconnects fail requests at once
    ever_connected: bool = False


class _Helpers:
    """Threads kept for the extra connections of :meth:`TcpTransport._run_bulk`
    (the stripes of a large item, the other peers of a sub-batch): a thread
    started per job cost each striped request a start-up hand-off, which on a
    busy 2-core host came late. A job never waits for a busy helper (a new
    thread is started then), so a silent peer still cannot hold up a live one;
    a helper idle for ``_HELPER_IDLE_S`` exits, and at most ``_HELPERS_KEPT``
    wait at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Any]] = []
        self._closed = False

    def submit(self, fn: Any, args: tuple[Any, ...]) -> threading.Event:
        """Run ``fn(*args)`` on an idle helper or a new thread; the event is set
        when it returns (or raises)."""
        done = threading.Event()
        with self._lock:
            q = self._idle.pop() if self._idle else None
        if q is not None:
            q.put((fn, args, done))
            return done
        q = queue.SimpleQueue()
        q.put((fn, args, done))
        threading.Thread(target=self._loop, args=(q,), daemon=True,
                         name="kvpool-tcp-bulk").start()
        return done

    def _loop(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            try:
                job = q.get(timeout=_HELPER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if q in self._idle:  # else a job was just handed to it: take it
                        self._idle.remove(q)
                        return
                job = q.get()
            if job is None:
                return
            fn, args, done = job
            try:
                fn(*args)
            except Exception:  # the job reports its own items; never lose the helper silently
                log.exception("tcp: bulk helper job failed")
            finally:
                done.set()
            del fn, args, done, job  # no references kept while idle
            with self._lock:
                if self._closed or len(self._idle) >= _HELPERS_KEPT:
                    return
                self._idle.append(q)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for q in idle:
            q.put(None)


@dataclass(frozen=True)
class _BulkPeer:
    """What a peer's ``ServerOp.BULK`` answer said (port 0: none, or not yet known)."""

    port: int = 0
    retry_at: float = 0.0  # monotonic time to ask again (port 0 only)
    max_bytes: int = 0  # largest single range
    max_header: int = 4096  # largest request header
    caps_table: bool = False  # takes a request's capability table
    published: bool = False  # taken from a segment descriptor, not asked


class TcpTransport(Transport):
    """Chunked, pipelined READ/WRITE through peers' transfer servers."""

    name = "tcp"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
        self._zctx: zmq.Context | None = None
        self._tls = threading.local()
        self._socks: set[zmq.Socket] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pool: PinnedPool | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._bulk_peers: dict[str, _BulkPeer] = {}
        self._bulk_all: set[BulkClient] = set()
        self._bulk_idle: dict[str, list[BulkClient]] = {}
        self.bulk_requests = 0
        self._helpers = _Helpers()

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return device == "cpu" or cuda_runtime()[0] is not None

    # -- sockets ----------------------------------------------------------------
    def _conn(self, endpoint: str) -> _Conn:
        """This thread's connection to ``endpoint`` (created on first use)."""
        conns: dict[str, _Conn] | None = getattr(self._tls, "conns", None)
        if conns is None:
            conns = self._tls.conns = {}
        c = conns.get(endpoint)
        if c is None:
            with self._lock:
                if self.closed:
                    raise TransferError("tcp transport closed", ErrorCode.CLOSED, retryable=False)
                if self._zctx is None:
                    self._zctx = zmq.Context()
                s = self._zctx.socket(zmq.DEALER)
                self._socks.add(s)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                       | zmq.EVENT_CONNECT_RETRIED)
            with self._lock:
                self._socks.add(mon)
            # CURVE towards the peer's transfer server (the engine's policy:
            # off for loopback peers unless forced on, on for every other one)
            curve = getattr(getattr(self, "ctx", None), "curve", None)
            if curve is not None:
                try:
                    curve.setup_client(s, endpoint)
                except Exception:
                    with self._lock:
                        self._socks.discard(s)
                        self._socks.discard(mon)
                    s.disable_monitor()
                    mon.close(linger=0)
                    s.close(linger=0)
                    raise
            s.connect(endpoint)
            c = conns[endpoint] = _Conn(endpoint, s, mon=mon)
        c.broken = False
        return c

    def _discard(self, conn: _Conn) -> None:
        conns: dict[str, _Conn] = getattr(self._tls, "conns", {})
        if conns.get(conn.endpoint) is conn:
            del conns[conn.endpoint]
        with self._lock:
            self._socks.discard(conn.sock)
            if conn.mon is not None:
                self._socks.discard(conn.mon)
        if conn.mon is not None:
            try:
                conn.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            conn.mon.close(linger=0)
        conn.sock.close(linger=0)

    def _peer_events(self, c: _Conn) -> str | None:
        """Consume monitor events; return why the peer is gone, or None."""
        if c.mon is None:
            return None
        why = None
        while c.mon.poll(0):
            try:
                ev = recv_monitor_message(c.mon, zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            event = ev.get("event")
            if event == zmq.EVENT_CONNECTED:
                c.ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                why = f"peer {c.endpoint} disconnected"
            elif event == zmq.EVENT_CONNECT_RETRIED:
                why = f"cannot connect to peer {c.endpoint}"
        return why

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
        peers: dict[str, _BulkPeer] = {}  # asked once per endpoint per sub-batch
        # the items of a sub-batch mostly share one segment (descriptor object):
        # what its endpoint gets is worked out once per run of it
        last_seg: SegmentDescriptor | None = None
        ep = ""
        peer: _BulkPeer | None = None
        bulk_list: list[WorkItem] | None = None
        for it in items:
            seg = it.segment
            if seg is not last_seg:
                last_seg, ep, peer, bulk_list = seg, seg.endpoint, None, None
                if ep and bulk_on and seg.kind == SegmentKind.MEMORY:
                    peer = peers.get(ep)
                    if peer is None:
                        peer = peers[ep] = self._bulk_peer(ep, seg)
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

    def _bulk_peer(self, endpoint: str, seg: SegmentDescriptor | None = None) -> _BulkPeer:
        """What is known of the peer's bulk socket (port 0: none, not known yet, or
        CURVE active towards it). Never blocks: a peer first met is taken at the
        word of its segment descriptor (``extra["bulk"]``, published by its
        owner), else asked in the background and served over ZeroMQ meanwhile.
        A peer that failed (refused connection) is asked, not taken at its word."""
        now = time.monotonic()
        with self._lock:
            peer = self._bulk_peers.get(endpoint)
            if peer is not None and (peer.port > 0 or now < peer.retry_at):
                return peer
            # (the CURVE check only here: a known peer, the common case, skips it)
            curve = getattr(getattr(self, "ctx", None), "curve", None)
            plain = curve is None or not curve.active(endpoint)
            hint = wire.bulk_hint(seg.extra) if peer is None and seg is not None and plain \
                else None
            if hint is not None:
                peer = self._bulk_peers[endpoint] = _BulkPeer(
                    hint.bulk, 0.0, hint.max, hint.hdr or 4096, hint.caps, published=True)
                return peer
            # negative until the answer arrives (or for _BULK_RETRY_S on failure)
            peer = self._bulk_peers[endpoint] = _BulkPeer(retry_at=now + _BULK_RETRY_S)
        if plain:
            self._ask_bulk(endpoint)
        return peer

    def _ask_bulk(self, endpoint: str) -> None:
        threading.Thread(target=self._query_bulk, args=(endpoint, 1.0), daemon=True,
                         name="kvpool-tcp-bulk-query").start()

    def _query_bulk(self, endpoint: str, timeout: float) -> None:
        with self._lock:
            if self.closed:
                return
            if self._zctx is None:
                self._zctx = zmq.Context()
            s = self._zctx.socket(zmq.DEALER)
            self._socks.add(s)
        try:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send(wire.encode(wire.ServerRequest(op=wire.ServerOp.BULK, id=0)))
            if not s.poll(int(timeout * 1000) + 1, zmq.POLLIN):
                return
            rep = wire.decode_reply(s.recv_multipart()[-1], offer=True)
            if isinstance(rep, wire.BulkOffer) and rep.code == ErrorCode.OK \
                    and 0 < rep.bulk < 65536:
                with self._lock:
                    self._bulk_peers[endpoint] = _BulkPeer(rep.bulk, 0.0, rep.max,
                                                           rep.hdr or 4096, rep.caps)
        except Exception as exc:  # an old or odd peer, or closing: no bulk path
            log.debug("tcp: bulk port of %s: %s", endpoint, exc)
        finally:
            with self._lock:
                self._socks.discard(s)
            try:
                s.close(linger=0)
            except zmq.ZMQError:
                pass

    # -- step 2: the bulk sockets -------------------------------------------------------
    def _bulk_checkout(self, endpoint: str, deadline: float) -> BulkClient | None:
        """An idle connection to the peer's bulk port, or a new one (None: cannot connect)."""
        with self._lock:
            idle = self._bulk_idle.get(endpoint)
            if idle:
                return idle.pop()
            peer = self._bulk_peers[endpoint]
        host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        try:
            bc = BulkClient(host, peer.port, min(2.0, deadline - time.monotonic()),
                            peer.max_header, peer.caps_table,
                            self.ctx.tcp_congestion if self.ctx is not None else "auto")
        except OSError as exc:
            log.debug("tcp: bulk connect %s:%d: %s", host, peer.port, exc)
            with self._lock:
                self._bulk_peers[endpoint] = _BulkPeer(
                    retry_at=time.monotonic() + _BULK_RETRY_S)
            if peer.published:  # a stale descriptor (the owner restarted?): ask the peer
                self._ask_bulk(endpoint)
            return None
        with self._lock:
            if self.closed:
                bc.close()
                return None
            self._bulk_all.add(bc)
        return bc

    def _bulk_checkin(self, endpoint: str, bc: BulkClient) -> None:
        with self._lock:
            if not bc.broken and not self.closed:
                self._bulk_idle.setdefault(endpoint, []).append(bc)
                return
            self._bulk_all.discard(bc)
        bc.close()

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
            clients = [self._bulk_checkout(ep, deadline) for _ in stripes]
            if any(bc is None for bc in clients):
                for bc in clients:
                    if bc is not None:
                        self._bulk_checkin(ep, bc)
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
                bc.run(its, deadline, rep if parts else rep_whole, _FINAL_CODES,
                       time.monotonic)
            finally:
                self.bulk_requests += len(its)
                self._bulk_checkin(ep, bc)

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
        for done in waits:
            done.wait(max(0.0, deadline - time.monotonic()) + 1.0)
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
        """``items`` as one list, or, for a lone item of at least ``_STRIPE_MIN``
        bytes, as ``threads`` stripes of it, each to go over its own connection
        (one TCP stream of one thread is slower than the link here: a single
        16 MiB put reached ~0.7x of 2-stream iperf3). ``parts`` maps each stripe
        to the whole item."""
        n = int(self.settings.threads)
        if n < 2 or len(items) != 1 or items[0].length < _STRIPE_MIN:
            return [items]
        it = items[0]
        step = -(-it.length // n) + 4095 & ~4095  # page-aligned stripes
        state: dict[str, Any] = {"left": 0, "reported": False}
        out = []
        for off in range(0, it.length, step):
            sub = dataclasses.replace(it, offset=it.offset + off,
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
        (they cost a single 4 KiB put or get about a third of its client
        CPU). False, having done nothing, where that does not apply: the
        general steps then serve them."""
        it0 = items[0]
        seg = it0.segment
        ep = seg.endpoint
        peer = self._bulk_peers.get(ep) if ep else None
        if peer is None and ep and "bulk" in seg.extra:  # first met: its descriptor's word
            peer = self._bulk_peer(ep, seg)
        if peer is None or peer.port <= 0 or seg.kind != SegmentKind.MEMORY \
                or not self.settings.options.get("bulk", True):
            return False
        max_bytes = peer.max_bytes
        if len(items) == 1:
            if it0.length > max_bytes or it0.buffer.device == "cuda" \
                    or (it0.length >= _STRIPE_MIN and int(self.settings.threads) > 1):
                return False
        else:  # (one list of several items is never striped)
            for it in items:
                if it.segment is not seg or it.length > max_bytes \
                        or it.buffer.device == "cuda":
                    return False
        bc = self._bulk_checkout(ep, deadline)
        if bc is None:  # the peer is marked as having no bulk port: ZeroMQ serves them
            return False

        try:
            bc.run(items, deadline, self._counted(report), _FINAL_CODES, time.monotonic)
        finally:
            self.bulk_requests += len(items)
            self._bulk_checkin(ep, bc)
        return True

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        if items and self._execute_direct(items, deadline, report):
            return
        by_ep, rest = self._route(items, report)
        if by_ep:
            rest += self._run_bulk(by_ep, deadline, report)
        if rest:
            _ZmqRun(self, rest, deadline, report).run()

    @staticmethod
    def _drain(sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def stats(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "bulk_requests": self.bulk_requests}

    def close(self) -> None:
        super().close()
        self._helpers.close()
        with self._lock:
            bulk, self._bulk_all = list(self._bulk_all), set()
            self._bulk_idle.clear()
        for bc in bulk:
            bc.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
            pool, self._pool = self._pool, None
            zctx, self._zctx = self._zctx, None
        for s in socks:
            try:
                s.close(linger=0)
            except zmq.ZMQError:
                pass
        if zctx is not None:
            zctx.term()
        if pool is not None:
            pool.close()


class _ZmqRun:
    """Step 3 of :meth:`TcpTransport.execute`: one sub-batch slice over ZeroMQ.

    :meth:`run` chunks the items per peer connection, then loops: :meth:`_pump`
    sends chunks up to the window, :meth:`_poll` waits for replies and
    monitor events (a disconnect fails that peer's chunks at once), and
    :meth:`_expire` fails what is left at the deadline. :meth:`_close` returns
    staging slots and discards every connection left with requests in flight
    (a stale request must never reach a later peer).
    """

    def __init__(self, tcp: TcpTransport, items: Sequence[WorkItem], deadline: float,
                 report: ReportFn) -> None:
        self.tcp = tcp
        self.deadline = deadline
        self.report = report
        self.conns: dict[str, _Conn] = {}
        self.states: list[_ItemState] = []
        self.rt: CudaRuntime | None = None
        self.pool: PinnedPool | None = None
        if any(it.buffer.is_gpu for it in items):
            self.rt, self.pool = tcp._staging()
        self.items = items
        self.window = tcp.settings.window
        self.poller = zmq.Poller()
        self.by_sock: dict[zmq.Socket, _Conn] = {}
        self.by_mon: dict[zmq.Socket, _Conn] = {}

    # -- setup ------------------------------------------------------------------------
    def _chunk(self) -> None:
        """Split every item into chunks queued on its peer's connection."""
        chunk = self.tcp.settings.chunk_bytes
        if self.pool is not None:
            chunk = min(chunk, self.pool.size)
        for it in self.items:
            conn = self.conns.get(it.segment.endpoint)
            if conn is None:
                conn = self.conns[it.segment.endpoint] = self.tcp._conn(it.segment.endpoint)
                self.tcp._peer_events(conn)  # old news from before this attempt
            st = _ItemState(it, (it.length + chunk - 1) // chunk)
            self.states.append(st)
            for off in range(0, it.length, chunk):
                conn.pending.append(_Chunk(st, off, min(chunk, it.length - off)))
        if self.pool is not None:
            self.window = max(1, min(self.window,
                                     len(self.pool._arrays) // max(1, len(self.conns))))
        for c in self.conns.values():
            self.poller.register(c.sock, zmq.POLLIN)
            self.by_sock[c.sock] = c
            if c.mon is not None:
                self.poller.register(c.mon, zmq.POLLIN)
                self.by_mon[c.mon] = c

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._chunk()
            while True:
                if self.tcp.closed:
                    raise TransferError("tcp transport closed", ErrorCode.CLOSED)
                self._pump()
                if not any(c.inflight for c in self.conns.values()):
                    if not any(c.pending and not c.broken for c in self.conns.values()):
                        break
                    continue
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._expire()
                    break
                self._poll(left)
        except TransferError as exc:
            for st in self.states:
                self._fail(st, exc)
            for c in self.conns.values():
                c.broken = True
        finally:
            self._close()

    def _fail(self, st: _ItemState, err: TransferError) -> None:
        if not st.failed and st.chunks_left > 0:
            st.failed = True
            self.report(st.item, err)

    def _give_up(self, c: _Conn, why: str, code: ErrorCode) -> None:
        c.broken = True
        for ch in [*c.inflight.values(), *c.pending]:
            self._release(ch)
            self._fail(ch.st, TransferError(why, code))
        c.inflight.clear()
        c.pending.clear()

    def _pump(self) -> None:
        """Send pending chunks while each connection's window has room."""
        pool = self.pool
        for c in self.conns.values():
            while c.pending and len(c.inflight) < self.window and not c.broken:
                ch = c.pending.popleft()
                if ch.st.failed:
                    continue
                if ch.st.item.buffer.is_gpu and pool is not None:
                    # Never hold staging slots and block for more: other threads
                    # share the pool, and our in-flight slots are only freed by
                    # this loop reading their replies.
                    if any(x.inflight for x in self.conns.values()):
                        ch.slot = pool.try_acquire()
                        if ch.slot < 0:
                            c.pending.appendleft(ch)
                            break
                    else:
                        try:
                            ch.slot = pool.acquire(max(0.0, self.deadline - time.monotonic()))
                        except TransferError as exc:
                            self._fail(ch.st, exc)
                            continue
                try:
                    self._send(c, ch)
                except TransferError as exc:
                    self._release(ch)
                    self._fail(ch.st, exc)

    def _poll(self, left: float) -> None:
        """Wait for replies or monitor events and handle them."""
        for sock, _ in self.poller.poll(int(min(left, 1.0) * 1000) + 1):
            if sock in self.by_mon:
                c = self.by_mon[sock]
                why = self.tcp._peer_events(c)
                if why and c.inflight:
                    # replies already queued still count; the rest is lost
                    while c.inflight and \
                            cast(int, c.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        self._recv(c)
                    self._give_up(c, why, ErrorCode.TRANSFER_FAIL)
                continue
            c = self.by_sock[sock]
            while c.inflight and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._recv(c)

    def _expire(self) -> None:
        for c in self.conns.values():
            if c.inflight or c.pending:
                self._give_up(c, f"no reply from {c.endpoint} before the deadline",
                              ErrorCode.TIMEOUT)

    def _close(self) -> None:
        for c in self.conns.values():
            for ch in c.inflight.values():
                self._release(ch)
            if c.broken or c.inflight:
                self.tcp._discard(c)  # stale requests must never reach a later peer

    # -- one chunk --------------------------------------------------------------------
    def _release(self, ch: _Chunk) -> None:
        if ch.slot >= 0 and self.pool is not None:
            self.pool.release(ch.slot)
            ch.slot = -1

    def _send(self, c: _Conn, ch: _Chunk) -> None:
        it = ch.st.item
        rt, pool = self.rt, self.pool
        cid = next(self.tcp._ids)
        hdr = wire.encode(wire.ServerRequest(int(it.op), cid, it.segment.segment_id,
                                             it.offset + ch.off, ch.n, it.capability))
        if it.buffer.is_gpu and ch.slot < 0:
            assert rt is not None and pool is not None
            ch.slot = pool.acquire(max(0.0, self.deadline - time.monotonic()))
        if it.op is TransferOp.READ:
            c.sock.send(hdr, copy=True)
        else:
            if it.buffer.is_gpu:
                assert rt is not None and pool is not None
                rt.copy(pool.ptr(ch.slot), it.buffer.ptr + it.buffer_offset + ch.off, ch.n,
                        it.buffer.device_index, it.independent)
                payload = pool.array(ch.slot)[:ch.n]
            else:
                payload = it.buffer.host_view(it.buffer_offset + ch.off, ch.n)
            c.sock.send(hdr, zmq.SNDMORE, copy=True)
            # the server's reply proves the payload left our buffer, so the
            # buffer (or staging slot) is reusable once the reply arrives
            c.sock.send(payload.data, 0, copy=ch.n < _MIN_ZERO_COPY)
            self.tcp.bytes_sent += ch.n
        c.inflight[cid] = ch

    def _recv(self, c: _Conn) -> None:
        sock = c.sock
        raw = sock.recv(copy=True)
        try:
            rep = wire.decode_reply(raw)
            code = ErrorCode(rep.code)
        except Exception:
            TcpTransport._drain(sock)
            log.warning("tcp: malformed reply from %s", c.endpoint)
            return
        ch = c.inflight.pop(rep.id, None) if rep.id is not None else None
        if ch is None:  # stale reply of an abandoned request
            TcpTransport._drain(sock)
            return
        st = ch.st
        try:
            if code != ErrorCode.OK:
                TcpTransport._drain(sock)
                raise TransferError(f"peer {c.endpoint}: {rep.err}", code,
                                    retryable=code not in _FINAL_CODES)
            if st.item.op is TransferOp.READ and not st.failed:
                self._recv_payload(sock, ch)
            else:
                TcpTransport._drain(sock)
        except TransferError as exc:
            self._release(ch)
            self._fail(st, exc)
            return
        self._release(ch)
        if st.failed:
            return
        st.chunks_left -= 1
        if st.chunks_left == 0:
            self.report(st.item, None)

    def _recv_payload(self, sock: zmq.Socket, ch: _Chunk) -> None:
        """A READ reply's payload frame, straight into the buffer (or staging slot)."""
        it = ch.st.item
        if not sock.getsockopt(zmq.RCVMORE):
            raise TransferError("READ reply without payload", ErrorCode.MALFORMED_FRAME)
        if it.buffer.is_gpu:
            rt, pool = self.rt, self.pool
            assert rt is not None and pool is not None
            got = sock.recv_into(pool.array(ch.slot)[:ch.n].data)
            if got == ch.n:
                rt.copy(it.buffer.ptr + it.buffer_offset + ch.off, pool.ptr(ch.slot), ch.n,
                        it.buffer.device_index, it.independent)
        else:
            got = sock.recv_into(it.buffer.host_view(it.buffer_offset + ch.off, ch.n).data)
        TcpTransport._drain(sock)
        if got != ch.n:
            raise TransferError(f"READ reply of {got} bytes, expected {ch.n}",
                                ErrorCode.MALFORMED_FRAME)
        self.tcp.bytes_received += ch.n
