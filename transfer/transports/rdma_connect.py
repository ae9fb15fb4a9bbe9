"""Queue pairs and connections of the ``rdma`` transport.

Per peer (the segment owner's connect endpoint) the requester
(:class:`RdmaConnector`) creates ``qps_per_peer`` RC QPs on one CQ and sends
an ``OP_RDMA_CONNECT`` request (:mod:`kvpool.transfer.rdma_proto`) to the
peer, whose responder (:class:`RdmaResponder`) creates as many QPs, moves
them INIT -> RTR -> RTS towards the requester's and replies with their QP
number/PSN/LID/GID/MTU and the registrations of the segments asked for; the
requester then moves its own QPs to RTS. A peer whose connects keep failing
is skipped for ``cooldown_s``. RDMA is one-sided: while the owner's transfer
server checks capabilities, the responder hands out no rkeys (unless
``allow_with_capabilities``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentKind, decode_frame, encode_frame
from kvpool.transfer.rdma_proto import (
    MAX_SEGMENTS_PER_CONNECT,
    ConnectReply,
    ConnectRequest,
    QpInfo,
    SegmentMr,
)
from kvpool.transfer.rdma_verbs import Access, CompletionQueue, QueuePair, VerbsError
from kvpool.transfer.transports.base import WorkItem
from kvpool.transfer.types import TransferError

if TYPE_CHECKING:
    from kvpool.transfer.transports.rdma import RdmaTransport

__all__ = ["Connection", "PeerState", "RdmaConnector", "RdmaResponder"]

log = logging.getLogger(__name__)


def _close_verbs(qps: Sequence[QueuePair], cq: CompletionQueue) -> None:
    """Close ``qps`` and then their CQ (the QPs must go first); a failure is
    logged and never raised, so one broken object does not leak the rest."""
    for qp in qps:
        try:
            qp.close()
        except Exception:
            log.debug("QP close failed", exc_info=True)
    try:
        cq.close()
    except Exception:
        log.debug("CQ close failed", exc_info=True)


class Connection:
    """The requester end towards one peer: a CQ, N connected QPs and the
    peer's segment registrations learned so far."""

    def __init__(self, endpoint: str, cq: CompletionQueue, qps: list[QueuePair],
                 max_sge: int = 1) -> None:
        self.endpoint = endpoint
        self.cq = cq
        self.qps = qps
        self.max_sge = max_sge  # what the QPs were created with (device limit applied)
        self.segments: dict[str, SegmentMr] = {}
        self.broken = False

    def to_error(self) -> None:
        for qp in self.qps:
            try:
                qp.to_error()
            except VerbsError:
                log.debug("QP %d -> ERR failed", qp.qp_num, exc_info=True)

    def close(self) -> None:
        _close_verbs(self.qps, self.cq)
        self.qps = []


@dataclass
class PeerState:
    """Per-peer bookkeeping; ``lock`` serialises sub-batches on one connection."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    conn: Connection | None = None
    connect_failures: int = 0
    down_until: float = 0.0
    last_error: str = ""


@dataclass
class _Accepted:
    """The responder end of one requester connection."""

    cq: CompletionQueue
    qps: list[QueuePair]

    def close(self) -> None:
        _close_verbs(self.qps, self.cq)


class _ConnectListener:
    """Serves OP_RDMA_CONNECT on its own ROUTER socket."""

    def __init__(self, zctx: zmq.Context, host: str,
                 handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._sock = zctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvpool-rdma-connect:{port}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2 or len(frames[1]) > 4096:
                    reply: dict[str, Any] = {"id": None, "code": int(ErrorCode.MALFORMED_FRAME),
                                             "err": "expected one header frame <= 4 KiB"}
                else:
                    try:
                        hdr = decode_frame(frames[1])
                        reply = self._handler(hdr if isinstance(hdr, dict) else {})
                    except KVPoolError as exc:
                        reply = {"id": None, "code": int(exc.code), "err": str(exc)}
                self._sock.send_multipart([frames[0], encode_frame(reply)])
            except zmq.ZMQError:
                if self._stop.is_set():
                    break
                log.debug("rdma connect listener socket error", exc_info=True)
            except Exception:  # never die on one bad request
                log.exception("rdma connect listener: unexpected error")
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


class RdmaConnector:
    """The requester side of ``rdma``: per peer endpoint a :class:`PeerState`
    with at most one :class:`Connection` (created on first use, dropped when
    broken), the peer's segment registrations learned from descriptors or
    connect replies, and the cooldown of a peer whose connects keep failing."""

    def __init__(self, rdma: RdmaTransport) -> None:
        self._rdma = rdma
        self._lock = threading.Lock()
        self._peers: dict[str, PeerState] = {}
        self._conn_prefix = uuid.uuid4().hex[:12]
        self._conn_ids = itertools.count(1)
        self._req_ids = itertools.count(1)

    def peer(self, endpoint: str) -> PeerState:
        """The state of ``endpoint`` (created on first use)."""
        with self._lock:
            p = self._peers.get(endpoint)
            if p is None:
                p = self._peers[endpoint] = PeerState()
            return p

    def _exchange(self, endpoint: str, req: ConnectRequest, deadline: float) -> ConnectReply:
        """Send one connect request and wait for the accepted reply (else TransferError)."""
        req.id = next(self._req_ids)
        timeout = min(self._rdma.options.connect_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            raise TransferError("deadline passed before connecting", ErrorCode.TIMEOUT)
        sock = self._rdma.zmq_context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(encode_frame(req.to_wire()))
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise TransferError(f"no rdma connect reply from {endpoint} in {timeout:.1f}s",
                                    ErrorCode.TIMEOUT)
            frames = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        try:
            reply = ConnectReply.from_wire(decode_frame(frames[0]))
        except KVPoolError as exc:
            raise TransferError(f"bad rdma connect reply from {endpoint}: {exc}",
                                exc.code) from exc
        if reply.code != ErrorCode.OK:
            hint = " (the owner advertised no rdma connect listener)" \
                if reply.code == ErrorCode.UNKNOWN_OP else ""
            raise TransferError(f"rdma connect refused by {endpoint}: "
                                f"{reply.code.name} {reply.err}{hint}", reply.code)
        return reply

    def _connect(self, endpoint: str, segment_ids: list[str], deadline: float) -> Connection:
        """A new connection: our QPs, the exchange, our QPs to RTS."""
        dev = self._rdma.device()
        info = dev.port_info()
        n = self._rdma.options.qps_per_peer
        depth = self._rdma.options.qp_depth
        max_sge = max(1, min(self._rdma.options.max_sge, dev.max_sge))
        cq = dev.create_cq(max(16, depth * n))
        qps: list[QueuePair] = []
        conn = Connection(endpoint, cq, qps, max_sge)
        try:
            access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
            for _ in range(n):
                qps.append(dev.create_qp(cq, depth, max_sge, access))
            host = getattr(self._rdma.ctx, "host_id", "") or ""
            mtu = self._rdma.port_mtu
            req = ConnectRequest(f"{self._conn_prefix}-{next(self._conn_ids)}", host,
                                 [QpInfo(q.qp_num, q.psn, info.lid, info.gid, mtu) for q in qps],
                                 segment_ids[:MAX_SEGMENTS_PER_CONNECT])
            reply = self._exchange(endpoint, req, deadline)
            if len(reply.qps) != len(qps):
                raise TransferError(f"peer answered {len(reply.qps)} QPs for {len(qps)}",
                                    ErrorCode.MALFORMED_FRAME)
            for qp, rq in zip(qps, reply.qps, strict=True):
                qp.connect(rq.remote(), min(mtu, rq.mtu), dev.max_rd_atomic)
            conn.segments.update({s.segment_id: s for s in reply.segments})
        except VerbsError as exc:
            conn.close()
            raise TransferError(f"rdma connect to {endpoint}: {exc}",
                                ErrorCode.TRANSFER_FAIL) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def ensure(self, peer: PeerState, endpoint: str, items: list[WorkItem],
               deadline: float) -> Connection:
        """The peer's connection, connected if needed, knowing every segment
        ``items`` name (else TransferError, counted towards the cooldown)."""
        wanted = sorted({it.segment.segment_id for it in items})
        conn = peer.conn
        try:
            if conn is None:
                missing = [s for s in wanted if not self._extra_mr(s, items)]
                conn = self._connect(endpoint, missing, deadline)
                peer.conn = conn
                self._rdma.counters["connects"] += 1
            for sid in wanted:  # learn what the descriptors carry
                if sid not in conn.segments:
                    mr = self._extra_mr(sid, items)
                    if mr is not None:
                        conn.segments[sid] = mr
            missing = [s for s in wanted if s not in conn.segments]
            if missing:
                reply = self._exchange(endpoint, ConnectRequest(
                    f"{self._conn_prefix}-q", getattr(self._rdma.ctx, "host_id", "") or "", [],
                    missing[:MAX_SEGMENTS_PER_CONNECT]), deadline)
                conn.segments.update({s.segment_id: s for s in reply.segments})
        except TransferError as exc:
            self._rdma.counters["connect_failures"] += 1
            peer.connect_failures += 1
            peer.last_error = str(exc)
            if peer.connect_failures >= self._rdma.settings.pause_after_failures:
                peer.down_until = time.monotonic() + self._rdma.settings.cooldown_s
                peer.connect_failures = 0
                log.warning("rdma peer %s skipped for %.1fs after repeated connect failures: "
                            "%s", endpoint, self._rdma.settings.cooldown_s, exc)
            raise
        peer.connect_failures = 0
        return conn

    @staticmethod
    def _extra_mr(segment_id: str, items: list[WorkItem]) -> SegmentMr | None:
        """The registration a descriptor of ``segment_id`` among ``items`` carries."""
        for it in items:
            if it.segment.segment_id == segment_id:
                extra = it.segment.extra.get("rdma") if isinstance(it.segment.extra, dict) \
                    else None
                if isinstance(extra, dict) and "rkey" in extra:
                    try:
                        return SegmentMr.from_extra(segment_id, extra)
                    except KVPoolError:
                        log.warning("segment %s: bad extra['rdma'] %r", segment_id, extra)
                return None
        return None

    @staticmethod
    def drop(peer: PeerState, conn: Connection) -> None:
        """Close a connection and forget it if it is the peer's."""
        conn.close()
        if peer.conn is conn:
            peer.conn = None

    @staticmethod
    def endpoint_of(item: WorkItem) -> str:
        """Where the owner of ``item``'s segment answers connects."""
        extra = item.segment.extra.get("rdma") if isinstance(item.segment.extra, dict) else None
        ep = extra.get("connect") if isinstance(extra, dict) else None
        return str(ep) if ep else item.segment.endpoint

    def forget_segment(self, segment_id: str) -> None:
        """Drop the peers' registrations of ``segment_id`` learned so far."""
        with self._lock:
            peers = list(self._peers.values())
        for p in peers:
            conn = p.conn
            if conn is not None:
                conn.segments.pop(segment_id, None)

    def stats(self) -> dict[str, Any]:
        """Per peer: connected, connect failures, cooldown left, last error."""
        with self._lock:
            return {ep: {"connected": p.conn is not None,
                         "connect_failures": p.connect_failures,
                         "down_for_s": max(0.0, p.down_until - time.monotonic()),
                         "last_error": p.last_error}
                    for ep, p in self._peers.items()}

    def close(self) -> None:
        """Close every connection (a sub-batch still polling notices the
        transport's ``closed`` and lets go promptly)."""
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            got = p.lock.acquire(timeout=2.0)
            try:
                if p.conn is not None:
                    p.conn.close()
                    p.conn = None
            finally:
                if got:
                    p.lock.release()


class RdmaResponder:
    """The owner side of ``rdma``: answers connect requests (responder QPs
    moved to RTS towards the requester's, and the registrations of the
    segments it asks for), through a connect listener of its own whose
    endpoint travels in the descriptors.
    At most ``max_accepted`` responder connections are kept (oldest closed)."""

    def __init__(self, rdma: RdmaTransport) -> None:
        self._rdma = rdma
        self._lock = threading.Lock()
        self._accepted: OrderedDict[str, _Accepted] = OrderedDict()
        self._listener: _ConnectListener | None = None

    def connect_endpoint(self) -> str:
        """Where peers send OP_RDMA_CONNECT: this owner's connect listener
        (started on first use). No transfer server routes that op, so the
        listener is the one way in."""
        with self._lock:
            if self._listener is None:
                server = getattr(self._rdma.ctx, "server", None)
                host = self._rdma.options.listen_host or getattr(server, "host", "") \
                    or "127.0.0.1"
                self._listener = _ConnectListener(self._rdma.zmq_context(), host,
                                                  self.handle_connect)
            return self._listener.endpoint

    def capabilities_enforced(self) -> bool:
        """Whether the transfer server checks capabilities and rdma may not
        bypass that (see RdmaOptions.allow_with_capabilities)."""
        server = getattr(self._rdma.ctx, "server", None)
        return getattr(server, "verify_capability", None) is not None \
            and not self._rdma.options.allow_with_capabilities

    def handle_connect(self, hdr: dict[str, Any]) -> dict[str, Any]:
        """Serve one OP_RDMA_CONNECT request (decoded header) and return the
        reply header. Never raises: errors become the reply's code/err."""
        rid = hdr.get("id") if isinstance(hdr.get("id"), int) else None
        try:
            req = ConnectRequest.from_wire(hdr)
            reply = self._accept(req)
        except KVPoolError as exc:
            log.info("rdma connect refused: %s", exc)
            return ConnectReply(0, exc.code, str(exc)).to_wire() | {"id": rid}
        except Exception as exc:
            log.exception("rdma connect failed")
            return ConnectReply(0, ErrorCode.INTERNAL_ERROR,
                                f"{type(exc).__name__}: {exc}").to_wire() | {"id": rid}
        return reply.to_wire()

    def _accept(self, req: ConnectRequest) -> ConnectReply:
        """Responder QPs towards the requester's, and the segments it asks for."""
        if self._rdma.closed:
            raise KVPoolError("rdma transport closed", ErrorCode.CLOSED)
        if self.capabilities_enforced():
            raise KVPoolError("capabilities are enforced here and RDMA cannot check them "
                              "per request; use tcp", ErrorCode.PERMISSION_DENIED)
        lookup = getattr(self._rdma.ctx, "local_segment", None)
        segs: list[SegmentMr] = []
        for sid in req.segments:
            seg = lookup(sid) if lookup is not None else None
            if seg is None or seg.kind != SegmentKind.MEMORY:
                raise KVPoolError(f"segment {sid!r} is not owned here",
                                  ErrorCode.SEGMENT_NOT_FOUND)
            mr = self._rdma.memory.segment_mr(seg)
            segs.append(SegmentMr(sid, mr.addr, mr.rkey, seg.size))
        qps: list[QpInfo] = []
        if req.qps:
            dev = self._rdma.device()
            info = dev.port_info()
            mtu = self._rdma.port_mtu
            depth = self._rdma.options.qp_depth
            cq = dev.create_cq(max(16, depth * len(req.qps)))
            mine: list[QueuePair] = []
            access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
            try:
                for rq in req.qps:
                    qp = dev.create_qp(cq, depth, 1, access)
                    mine.append(qp)
                    qp.connect(rq.remote(), min(mtu, rq.mtu), dev.max_rd_atomic)
                    qps.append(QpInfo(qp.qp_num, qp.psn, info.lid, info.gid, mtu))
            except VerbsError as exc:
                _Accepted(cq, mine).close()
                raise KVPoolError(f"responder QP setup: {exc}", ErrorCode.TRANSFER_FAIL) \
                    from exc
            key = f"{req.host}/{req.conn}"
            with self._lock:
                old = self._accepted.pop(key, None)
                self._accepted[key] = _Accepted(cq, mine)
                evicted = []
                while len(self._accepted) > self._rdma.options.max_accepted:
                    evicted.append(self._accepted.popitem(last=False)[1])
                self._rdma.counters["accepted"] += 1
            for a in ([old] if old else []) + evicted:
                a.close()
        return ConnectReply(req.id, ErrorCode.OK, "", qps, segs)

    @property
    def accepted_connections(self) -> int:
        """Responder connections kept."""
        with self._lock:
            return len(self._accepted)

    def close(self) -> None:
        """Close the listener and every responder connection."""
        with self._lock:
            accepted = list(self._accepted.values())
            self._accepted.clear()
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for a in accepted:
            a.close()
