"""The ZeroMQ path of the ``tcp`` transport: requests through the peer's
transfer server (GPU buffers, peers with CURVE or without a bulk socket, the
first requests to a peer whose descriptor does not publish its bulk port).

:class:`ZmqSockets` keeps, per worker thread, one DEALER socket per peer
endpoint (with a socket monitor: a disconnect fails that peer's requests at
once), plus the one-off sockets of bulk-port queries; all are closed with the
transport. :class:`ZmqRun` moves one slice: a request is split into
``chunk_size`` chunks, up to ``window`` chunks per connection are in flight at
once, and the requests to different peers progress in one poll loop. Frames
are zero-copy: WRITE payloads are sent straight from the caller's buffer
(``copy=False``), READ payloads received straight into it (``recv_into``). GPU
buffers are staged through a pool of pinned host buffers in both directions. A
peer that stops answering fails its requests (retryably, with TIMEOUT) at the
deadline and its socket is discarded so no stale request is delivered later.
Headers: :mod:`kvpool.transfer.wire`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.core.errors import ErrorCode
from kvpool.transfer import wire
from kvpool.transfer.gpu import CudaRuntime, PinnedPool
from kvpool.transfer.transports.base import ReportFn, WorkItem
from kvpool.transfer.types import TransferError, TransferOp

if TYPE_CHECKING:
    from kvpool.transfer.transports.tcp import TcpTransport

__all__ = ["FINAL_CODES", "ZmqRun", "ZmqSockets"]

log = logging.getLogger(__name__)

_MIN_ZERO_COPY = 64 << 10
#: server refusals that no other attempt can fix (either path)
FINAL_CODES = {
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


def _drain(sock: zmq.Socket) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(copy=False)


class ZmqSockets:
    """The ZeroMQ sockets of one tcp transport. ``socks`` holds every socket
    open now (none until the first request or query needs one); ``curve()``
    returns the CURVE policy towards peers (None: plain)."""

    def __init__(self, curve: Any) -> None:
        self._curve = curve
        self._ctx: zmq.Context | None = None
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.socks: set[zmq.Socket] = set()
        self.closed = False

    def socket(self) -> zmq.Socket:
        """A new DEALER socket, kept in ``socks`` until :meth:`release`d."""
        with self._lock:
            if self.closed:
                raise TransferError("tcp transport closed", ErrorCode.CLOSED, retryable=False)
            if self._ctx is None:
                self._ctx = zmq.Context()
            s = self._ctx.socket(zmq.DEALER)
            self.socks.add(s)
        return s

    def release(self, s: zmq.Socket) -> None:
        """Close a socket of :meth:`socket`."""
        with self._lock:
            self.socks.discard(s)
        try:
            s.close(linger=0)
        except zmq.ZMQError:
            pass

    def conn(self, endpoint: str) -> _Conn:
        """This thread's connection to ``endpoint`` (created on first use)."""
        conns: dict[str, _Conn] | None = getattr(self._tls, "conns", None)
        if conns is None:
            conns = self._tls.conns = {}
        c = conns.get(endpoint)
        if c is None:
            s = self.socket()
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                       | zmq.EVENT_CONNECT_RETRIED)
            with self._lock:
                self.socks.add(mon)
            # CURVE towards the peer's transfer server (the engine's policy:
            # off for loopback peers unless forced on, on for every other one)
            curve = self._curve()
            if curve is not None:
                try:
                    curve.setup_client(s, endpoint)
                except Exception:
                    with self._lock:
                        self.socks.discard(s)
                        self.socks.discard(mon)
                    s.disable_monitor()
                    mon.close(linger=0)
                    s.close(linger=0)
                    raise
            s.connect(endpoint)
            c = conns[endpoint] = _Conn(endpoint, s, mon=mon)
        c.broken = False
        return c

    def discard(self, conn: _Conn) -> None:
        """Close a connection (a stale request must never reach a later peer)."""
        conns: dict[str, _Conn] = getattr(self._tls, "conns", {})
        if conns.get(conn.endpoint) is conn:
            del conns[conn.endpoint]
        with self._lock:
            self.socks.discard(conn.sock)
            if conn.mon is not None:
                self.socks.discard(conn.mon)
        if conn.mon is not None:
            try:
                conn.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            conn.mon.close(linger=0)
        conn.sock.close(linger=0)

    @staticmethod
    def peer_events(c: _Conn) -> str | None:
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

    def close(self) -> None:
        """Close every socket and the context. Idempotent."""
        with self._lock:
            self.closed = True
            socks = list(self.socks)
            self.socks.clear()
            ctx, self._ctx = self._ctx, None
        for s in socks:
            try:
                s.close(linger=0)
            except zmq.ZMQError:
                pass
        if ctx is not None:
            ctx.term()


class ZmqRun:
    """One sub-batch slice over ZeroMQ (what :meth:`TcpTransport.execute` does not
    send over a bulk socket).

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
                conn = self.conns[it.segment.endpoint] = self.tcp.zmq.conn(it.segment.endpoint)
                self.tcp.zmq.peer_events(conn)  # old news from before this attempt
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
                why = self.tcp.zmq.peer_events(c)
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
                self.tcp.zmq.discard(c)  # stale requests must never reach a later peer

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
            _drain(sock)
            log.warning("tcp: malformed reply from %s", c.endpoint)
            return
        ch = c.inflight.pop(rep.id, None) if rep.id is not None else None
        if ch is None:  # stale reply of an abandoned request
            _drain(sock)
            return
        st = ch.st
        try:
            if code != ErrorCode.OK:
                _drain(sock)
                raise TransferError(f"peer {c.endpoint}: {rep.err}", code,
                                    retryable=code not in FINAL_CODES)
            if st.item.op is TransferOp.READ and not st.failed:
                self._recv_payload(sock, ch)
            else:
                _drain(sock)
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
        _drain(sock)
        if got != ch.n:
            raise TransferError(f"READ reply of {got} bytes, expected {ch.n}",
                                ErrorCode.MALFORMED_FRAME)
        self.tcp.bytes_received += ch.n
