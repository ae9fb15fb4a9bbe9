"""The transfer server's ZeroMQ loop: READ/WRITE into this process's segments
for peers whose transport needs a server hop (``tcp``), plus the control ops.

Wire protocol (ZeroMQ ROUTER; peers connect a DEALER): a header frame
(:class:`~kvpool.transfer.wire.ServerRequest`, a msgpack map ``{op, id, seg,
off, len, cap}``; ``op`` a :class:`~kvpool.transfer.wire.ServerOp`), then
exactly ``len`` payload bytes for a WRITE. Reply: a
:class:`~kvpool.transfer.wire.ServerReply` frame ``{id, code, err}``, then
``len`` bytes for a successful READ; BULK answers a
:class:`~kvpool.transfer.wire.BulkOffer`, STATS a
:class:`~kvpool.transfer.wire.StatsReply` (served, refused,
capability_refusals by reason, ...).

``off`` is relative to the segment's usable region. A header must decode
(MALFORMED_FRAME) and fit ``max_header_bytes`` (FRAME_TOO_LARGE); then the
READ/WRITE range is checked, before any byte moves, by the segment server's
one validator (:meth:`Holder.check`, a batch of one: segment owned here, op
known and allowed, size limit, bounds, capability). With ``curve`` the socket
requires ZeroMQ CURVE (an unauthenticated peer cannot complete the handshake
and gets nothing). The server never dies on bad input. WRITE payloads are
received straight into the segment (``recv_into``) and READ payloads sent
zero-copy from it. Each request served is recorded once, after its reply
(:class:`~kvpool.transfer.counters.OpCounter`: range, bytes, seconds).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol, cast

import zmq

from kvpool.core.auth import CurveAuthenticator, CurveConfig
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer import wire
from kvpool.transfer.config import ServerConfig
from kvpool.transfer.counters import OpCells, OpCounter
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.types import TransferOp
from kvpool.transfer.wire import ServerOp, ServerRequest

__all__ = ["OP_BULK", "OP_PING", "Holder", "TransferServer"]

log = logging.getLogger(__name__)

OP_PING = ServerOp.PING
OP_BULK = ServerOp.BULK
_CONTROL_OPS = (ServerOp.PING, ServerOp.STATS, ServerOp.BULK)
_MIN_ZERO_COPY = 64 << 10  # below this, copying the frame is cheaper than tracking it


class Holder(Protocol):
    """What the loop serves for (the segment server)."""

    def check(self, op: int, items: list[wire.BulkItem], table: list[bytes]
              ) -> tuple[list[int], list[LocalSegment | None], KVPoolError | None]:
        """The one validator: a code and a segment (None where refused) per
        range, and the first refusal (None when all are accepted)."""

    def count(self, served: int, refused: int) -> None:
        """Record requests served and refused."""

    def stats(self) -> dict[str, Any]:
        """What a STATS request answers."""

    def bulk_offer(self, rid: int | None = 0) -> wire.BulkOffer:
        """What a BULK request answers."""


def _msg(exc: KVPoolError) -> str:
    return str(exc.args[0]) if exc.args else exc.code.name


class TransferServer:
    """ROUTER socket on ``tcp://bind_host:port`` (port 0 = ephemeral) served by
    one thread for ``holder``. ``endpoint`` is the address peers connect to;
    ``curve`` whether CURVE is on. ``cells``: where the requests served are
    recorded, by op (own ones if None). ``close()`` stops it."""

    def __init__(self, holder: Holder, bind_host: str = "127.0.0.1", port: int = 0,
                 config: ServerConfig | None = None, curve: CurveConfig | None = None,
                 cells: OpCells | None = None) -> None:
        self.config = config or ServerConfig()
        self._holder = holder
        self.cells: OpCells = cells or (OpCounter(), OpCounter(), OpCounter())
        self._ctx = zmq.Context(io_threads=self.config.io_threads)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # bounded per-peer queue: a flooding peer is back-pressured in TCP
        self._sock.setsockopt(zmq.RCVHWM, int(self.config.max_queued_requests))
        self._sock.setsockopt(zmq.MAXMSGSIZE, int(self.config.max_request_bytes) + 4096)
        self._auth: CurveAuthenticator | None = None
        if curve is not None:
            try:
                self._auth = curve.setup_server(self._sock, bind_host)
            except BaseException:
                self._sock.close(0)
                self._ctx.term()
                raise
        self.curve = self._auth is not None
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.host = bind_host
        self.port = port
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvpool-xfer-server:{port}",
                                        daemon=True)
        self._thread.start()

    @property
    def curve_denied(self) -> int:
        """Handshakes CURVE refused."""
        return self._auth.denied if self._auth else 0

    # -- loop ---------------------------------------------------------------
    def _run(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    self._serve_one(sock)
            except zmq.ContextTerminated:
                break
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.warning("transfer server socket error: %s", exc)
            except Exception:  # never die on one bad request
                log.exception("transfer server: unexpected error")
        try:
            sock.close(linger=0)
        except zmq.ZMQError:
            pass

    @staticmethod
    def _drain(sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def _refuse(self, sock: zmq.Socket, ident: Any, rid: int | None, exc: KVPoolError) -> None:
        """Drop the rest of the request, count it refused and answer why."""
        self._drain(sock)
        self._holder.count(0, 1)
        self._send_reply(sock, ident, wire.ServerReply(rid, int(exc.code), _msg(exc)))

    @staticmethod
    def _send_reply(sock: zmq.Socket, ident: Any, rep: wire.ServerReply,
                    payload: Any = None) -> None:
        hdr = wire.encode(rep)
        if payload is None:
            sock.send_multipart([ident, hdr], copy=True)
        else:
            sock.send(ident, zmq.SNDMORE)
            sock.send(hdr, zmq.SNDMORE)
            sock.send(payload, copy=len(payload) < _MIN_ZERO_COPY)

    def _serve_one(self, sock: zmq.Socket) -> None:
        t0 = time.monotonic()
        ident = sock.recv(copy=True)
        if not sock.getsockopt(zmq.RCVMORE):
            self._refuse(sock, ident, None,
                         KVPoolError("missing header frame", ErrorCode.MALFORMED_FRAME))
            return
        hframe = sock.recv(copy=False)
        rid: int | None = None
        try:
            if len(hframe) > self.config.max_header_bytes:
                raise KVPoolError(f"header of {len(hframe)} bytes", ErrorCode.FRAME_TOO_LARGE)
            try:
                req = wire.decode_request(hframe.buffer)
            except KVPoolError:
                rid = wire.request_id(hframe.buffer)  # echo a readable id with the refusal
                raise
        except KVPoolError as exc:
            self._refuse(sock, ident, rid, exc)
            return
        rid = req.id
        if req.op in _CONTROL_OPS:
            self._drain(sock)
            self._serve_control(sock, ident, req)
            return
        _codes, segs, refusal = self._holder.check(
            req.op, [wire.BulkItem(req.seg, req.off, req.len, req.cap)], [])
        seg = segs[0]
        if seg is None:
            assert refusal is not None
            self._refuse(sock, ident, rid, refusal)
            return
        try:
            if req.op == TransferOp.WRITE:
                self._serve_write(sock, seg, req.off, req.len)
                self._send_reply(sock, ident, wire.ServerReply(rid, 0))
            else:
                self._drain(sock)
                self._send_reply(sock, ident, wire.ServerReply(rid, 0),
                                 seg.read_payload(req.off, req.len))
            self._holder.count(1, 0)
            self.cells[req.op].record(1, req.len, time.monotonic() - t0)
        except KVPoolError as exc:
            self._refuse(sock, ident, rid, exc)

    def _serve_control(self, sock: zmq.Socket, ident: Any, req: ServerRequest) -> None:
        """PING, STATS and BULK: no segment, no payload."""
        rep: wire.ServerReply
        if req.op == ServerOp.BULK:
            rep = self._holder.bulk_offer(req.id)
        elif req.op == ServerOp.STATS:
            rep = wire.StatsReply(req.id, 0, stats=self._holder.stats())
        else:
            rep = wire.ServerReply(req.id, 0)
        self._send_reply(sock, ident, rep)

    def _serve_write(self, sock: zmq.Socket, seg: LocalSegment, off: int, n: int) -> None:
        if not sock.getsockopt(zmq.RCVMORE):
            raise KVPoolError("WRITE without payload frame", ErrorCode.MALFORMED_FRAME)
        view = seg.view()
        if view is not None:
            # receive straight into the segment; a size mismatch is refused
            # (the bytes already landed inside the validated range only)
            got = sock.recv_into(view[off:off + n])
            if got != n:
                self._drain(sock)
                raise KVPoolError(f"payload of {got} bytes, header says {n}",
                                  ErrorCode.MALFORMED_FRAME)
        else:
            frame = sock.recv(copy=False)
            if len(frame) != n:
                self._drain(sock)
                raise KVPoolError(f"payload of {len(frame)} bytes, header says {n}",
                                  ErrorCode.MALFORMED_FRAME)
            seg.write_from(off, frame.buffer)
        self._drain(sock)

    def close(self) -> None:
        """Stop the loop and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._auth is not None:  # its ZAP sockets live on our context: stop it first
            self._auth.close()
            self._auth = None
        self._ctx.term() if not self._thread.is_alive() else self._ctx.destroy(linger=0)
