"""The transfer server: serves READ/WRITE into this process's segments for
peers whose transport needs a server hop (``tcp``).

Wire protocol (ZeroMQ ROUTER; peers connect a DEALER): a header frame
(:class:`~kvpool.transfer.wire.ServerRequest`, a msgpack map ``{op, id, seg,
off, len, cap}``; ``op`` a :class:`~kvpool.transfer.wire.ServerOp`), then
exactly ``len`` payload bytes for a WRITE. Reply: a
:class:`~kvpool.transfer.wire.ServerReply` frame ``{id, code, err}``, then
``len`` bytes for a successful READ; BULK answers a
:class:`~kvpool.transfer.wire.BulkOffer`, STATS a
:class:`~kvpool.transfer.wire.StatsReply` (served, refused,
capability_refusals by reason, ...).

``off`` is relative to the segment's usable region. Every request is
validated before any byte moves: header fields of the right types
(MALFORMED_FRAME), segment owned here (SEGMENT_NOT_FOUND), op known and
allowed on the segment (UNKNOWN_OP / PERMISSION_DENIED), length below
``max_request_bytes`` (FRAME_TOO_LARGE), range inside the segment
(OUT_OF_BOUNDS), then the capability hook
(:attr:`TransferServer.verify_capability`: PERMISSION_DENIED with the
reason). With ``curve`` the socket requires ZeroMQ CURVE (an unauthenticated
peer cannot complete the handshake and gets nothing). The server never dies
on bad input. WRITE payloads are received straight into the segment
(``recv_into``) and READ payloads sent zero-copy from it. The bulk path
(:mod:`kvpool.transfer.bulk`) applies the same range validation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import zmq

from kvpool.core.auth import CurveAuthenticator, CurveConfig
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer import wire
from kvpool.transfer.bulk import BulkServer
from kvpool.transfer.config import ServerConfig
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.types import TransferOp
from kvpool.transfer.wire import ServerOp, ServerRequest

__all__ = ["OP_BULK", "OP_PING", "CapabilityVerifier", "TransferServer"]

log = logging.getLogger(__name__)

OP_PING = ServerOp.PING
OP_BULK = ServerOp.BULK
_CONTROL_OPS = (ServerOp.PING, ServerOp.STATS, ServerOp.BULK)
_MIN_ZERO_COPY = 64 << 10  # below this, copying the frame is cheaper than tracking it

#: (segment, op, offset, length, capability) -> None to allow, or an ErrorCode to refuse.
CapabilityVerifier = Callable[[LocalSegment, TransferOp, int, int, bytes], ErrorCode | None]
#: (segment, op, offsets, lengths, capability) -> True when the capability allows
#: every range; False sends each range to the CapabilityVerifier (which refuses).
CapabilityBatchVerifier = Callable[[LocalSegment, TransferOp, list[int], list[int], bytes], bool]


def _msg(exc: KVPoolError) -> str:
    return str(exc.args[0]) if exc.args else exc.code.name


class TransferServer:
    """ROUTER socket on ``tcp://bind_host:port`` (port 0 = ephemeral) served by
    one thread. ``lookup(segment_id)`` returns the owned segment or None.
    ``endpoint`` is the address peers connect to. ``tcp_congestion``: the
    policy of the bulk socket's connections (TransferConfig.tcp_congestion).
    ``close()`` stops it."""

    def __init__(
        self,
        lookup: Callable[[str], LocalSegment | None],
        bind_host: str = "127.0.0.1",
        port: int = 0,
        config: ServerConfig | None = None,
        curve: CurveConfig | None = None,
        tcp_congestion: str = "auto",
    ) -> None:
        self.config = config or ServerConfig()
        self._max_request = int(self.config.max_request_bytes)
        #: extra counters for STATS replies (e.g. the engine's capability refusals)
        self.stats_hook: Callable[[], dict[str, Any]] | None = None
        self._lookup = lookup
        #: capability check: verify TransferRequest.capability per request (None = allow all)
        self.verify_capability: CapabilityVerifier | None = None
        #: the same check for all ranges of a bulk request under one token
        #: (see set_capability_check; used only beside the hook it was set with)
        self.verify_capability_many: CapabilityBatchVerifier | None = None
        self._many_of: CapabilityVerifier | None = None
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
        self.requests_served = 0
        self.requests_refused = 0
        # payloads straight into place over plain TCP (never beside CURVE)
        self.bulk: BulkServer | None = None
        if self.config.bulk and not self.curve:
            self.bulk = BulkServer(bind_host, self._validate_many, self._count,
                                   int(self.config.max_header_bytes),
                                   int(self.config.max_request_bytes), tcp_congestion)
        self._thread = threading.Thread(target=self._run, name=f"kvpool-xfer-server:{port}",
                                        daemon=True)
        self._thread.start()

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

    def _drain(self, sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def _count(self, ok: bool, n: int = 1) -> None:
        if ok:
            self.requests_served += n
        else:
            self.requests_refused += n

    def _reply(self, sock: zmq.Socket, ident: Any, rid: int | None, code: ErrorCode,
               err: str = "", payload: Any = None) -> None:
        self._send_reply(sock, ident, wire.ServerReply(rid, int(code), err), payload)

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
        ident = sock.recv(copy=True)
        if not sock.getsockopt(zmq.RCVMORE):
            self.requests_refused += 1
            self._reply(sock, ident, None, ErrorCode.MALFORMED_FRAME, "missing header frame")
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
            rid = req.id
            seg = self._validate(req)
        except KVPoolError as exc:
            self._drain(sock)
            self.requests_refused += 1
            self._reply(sock, ident, rid, exc.code, _msg(exc))
            return
        if seg is None:
            self._drain(sock)
            self._serve_control(sock, ident, req)
            return
        try:
            if req.op == TransferOp.WRITE:
                self._serve_write(sock, seg, req.off, req.len)
                self._reply(sock, ident, rid, ErrorCode.OK)
            else:
                self._drain(sock)
                self._reply(sock, ident, rid, ErrorCode.OK,
                            payload=seg.read_payload(req.off, req.len))
            self.requests_served += 1
        except KVPoolError as exc:
            self._drain(sock)
            self.requests_refused += 1
            self._reply(sock, ident, rid, exc.code, _msg(exc))

    def bulk_offer(self, rid: int | None = 0) -> wire.BulkOffer:
        """What ``ServerOp.BULK`` answers: the bulk port (0: none) and its limits.
        Also published ahead in the ``extra["bulk"]`` of this server's memory
        segments' descriptors, so a peer's first request need not ask."""
        return wire.BulkOffer(rid, 0, bulk=self.bulk.port if self.bulk is not None else 0,
                              max=int(self.config.max_request_bytes),
                              hdr=int(self.config.max_header_bytes), caps=True)

    def bulk_extra(self) -> dict[str, Any]:
        """The ``extra`` entry of this server's memory segments' descriptors:
        ``{"bulk": {...}}`` (see :func:`wire.bulk_hint`), {} without a bulk socket."""
        if self.bulk is None:
            return {}
        o = self.bulk_offer()
        return {"bulk": {"bulk": o.bulk, "max": o.max, "hdr": o.hdr, "caps": o.caps}}

    def _serve_control(self, sock: zmq.Socket, ident: Any, req: ServerRequest) -> None:
        """PING, STATS and BULK: no segment, no payload."""
        rep: wire.ServerReply
        if req.op == ServerOp.BULK:
            rep = self.bulk_offer(req.id)
        elif req.op == ServerOp.STATS:
            rep = wire.StatsReply(req.id, 0, stats=self.stats())
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

    def _validate(self, req: ServerRequest) -> LocalSegment | None:
        """The segment a READ/WRITE request may touch (None for a control op);
        raises KVPoolError with the refusal's code."""
        if req.op in _CONTROL_OPS:
            return None
        if req.op not in (TransferOp.READ, TransferOp.WRITE):
            raise KVPoolError(f"unknown op {req.op!r}", ErrorCode.UNKNOWN_OP)
        return self._validate_range(TransferOp(req.op), req.seg, req.off, req.len, req.cap)

    def _validate_range(self, top: TransferOp, sid: str, off: int, n: int,
                        cap: bytes) -> LocalSegment:
        """One READ/WRITE range (both the ZeroMQ and the bulk path): the segment,
        or KVPoolError (SEGMENT_NOT_FOUND, PERMISSION_DENIED, FRAME_TOO_LARGE,
        OUT_OF_BOUNDS, or the capability check's code)."""
        seg = self._segment_for(top, sid)
        if n > self._max_request:
            raise KVPoolError(f"request of {n} bytes exceeds {self.config.max_request_bytes}",
                              ErrorCode.FRAME_TOO_LARGE)
        if off < 0 or n < 0 or off + n > seg.size:
            raise KVPoolError(f"range [{off}, {off + n}) outside segment {sid!r} of "
                              f"{seg.size} bytes", ErrorCode.OUT_OF_BOUNDS)
        verifier = self.verify_capability  # _check_capability, inlined: once per range
        if verifier is not None:
            code = verifier(seg, top, off, n, cap)
            if code is not None and code != ErrorCode.OK:
                raise KVPoolError(f"capability refused for {sid!r}", code)
        return seg

    def _validate_many(self, top: TransferOp, items: list[wire.BulkItem], table: list[bytes]
                       ) -> tuple[list[int], list[LocalSegment | None], str]:
        """Every range of one bulk request, with the checks of
        :meth:`_validate_range` each: (codes, segments (None where refused),
        the first refusal's message). What depends only on the segment (owned
        here, op allowed) is looked up once per segment and request; bounds,
        size and the capability are checked per range. ``item.cap`` is a token
        or an index into ``table``."""
        fast = self._validate_fast(top, items, table)
        if fast is not None:
            return fast
        codes: list[int] = []
        segs: list[LocalSegment | None] = []
        err = ""
        known: dict[str, LocalSegment | tuple[ErrorCode, str]] = {}
        max_n = self._max_request
        verifier = self.verify_capability
        ntable = len(table)
        ok = 0
        for it in items:
            sid, off, n, ref = it.seg, it.off, it.len, it.cap
            try:
                if type(ref) is int:  # an index into the request's table
                    if not 0 <= ref < ntable:
                        raise KVPoolError(f"capability index {ref} outside the request's "
                                          f"{ntable}", ErrorCode.MALFORMED_FRAME)
                    cap = table[ref]
                else:
                    cap = cast(bytes, ref)
                seg = known.get(sid)
                if seg is None:
                    try:
                        seg = self._segment_for(top, sid)
                    except KVPoolError as exc:  # kept as (code, text): no traceback cycle
                        seg = (exc.code, _msg(exc))
                    known[sid] = seg
                if type(seg) is tuple:
                    raise KVPoolError(seg[1], seg[0])
                seg = cast(LocalSegment, seg)
                if n > max_n:
                    raise KVPoolError(f"request of {n} bytes exceeds {max_n}",
                                      ErrorCode.FRAME_TOO_LARGE)
                if off < 0 or n < 0 or off + n > seg.size:
                    raise KVPoolError(f"range [{off}, {off + n}) outside segment {sid!r} of "
                                      f"{seg.size} bytes", ErrorCode.OUT_OF_BOUNDS)
                if verifier is not None:
                    code = verifier(seg, top, off, n, cap)
                    if code is not None and code != ErrorCode.OK:
                        raise KVPoolError(f"capability refused for {sid!r}", code)
                segs.append(seg)
                codes.append(0)
                ok += 1
            except KVPoolError as exc:
                segs.append(None)
                codes.append(int(exc.code))
                err = err or str(exc)
        self.requests_served += ok
        self.requests_refused += len(items) - ok
        return codes, segs, err

    def set_capability_check(self, one: CapabilityVerifier,
                             many: CapabilityBatchVerifier | None = None) -> None:
        """Install the capability check: ``one`` per range, ``many`` (optional)
        for all ranges of a bulk request under one token at once. ``many`` is
        used only while ``verify_capability`` is still ``one``: a hook set
        directly later is asked range by range."""
        self.verify_capability = one
        self.verify_capability_many = many
        self._many_of = one

    def _validate_fast(self, top: TransferOp, items: list[wire.BulkItem], table: list[bytes]
                       ) -> tuple[list[int], list[LocalSegment | None], str] | None:
        """:meth:`_validate_many` of the common request: every range on one
        segment under one token, all of them allowed. The segment is looked up
        once, bounds and size checked per range, the capability once for all
        ranges (``verify_capability_many``). None when any of that does not
        hold: the caller then checks range by range (and refuses with codes)."""
        if not items:
            return None
        first = items[0]
        sid, ref = first.seg, first.cap
        verifier = self.verify_capability
        if type(ref) is int:
            if not 0 <= ref < len(table):
                return None
            cap = table[ref]
        else:
            cap = cast(bytes, ref)
        seg = self._lookup(sid)
        if seg is None or top not in seg.allowed_ops:
            return None
        size, max_n = seg.size, self._max_request
        offs: list[int] = []
        lens: list[int] = []
        for it in items:
            off, n = it.off, it.len
            if it.seg != sid or it.cap != ref or off < 0 or n < 0 or n > max_n \
                    or off + n > size:
                return None
            offs.append(off)
            lens.append(n)
        if verifier is not None:
            many = self.verify_capability_many
            if many is None or self._many_of != verifier \
                    or not many(seg, top, offs, lens, cap):
                return None
        self.requests_served += len(items)
        return [0] * len(items), [seg] * len(items), ""

    def _segment_for(self, top: TransferOp, sid: str) -> LocalSegment:
        """The segment ``sid`` if it is owned here and allows ``top``."""
        seg = self._lookup(sid)
        if seg is None:
            raise KVPoolError(f"segment {sid!r} is not owned here", ErrorCode.SEGMENT_NOT_FOUND)
        if top not in seg.allowed_ops:
            raise KVPoolError(f"{top.name} not allowed on segment {sid!r}",
                              ErrorCode.PERMISSION_DENIED)
        return seg

    def _check_capability(self, seg: LocalSegment, top: TransferOp, off: int, n: int,
                          cap: bytes) -> None:
        """The capability check, per range, before any byte moves."""
        sid = seg.segment_id
        verifier = self.verify_capability
        if verifier is not None:
            code = verifier(seg, top, off, n, cap)
            if code is not None and code != ErrorCode.OK:
                raise KVPoolError(f"capability refused for {sid!r}", code)

    def stats(self) -> dict[str, Any]:
        """Counters: requests served / refused, CURVE, plus ``stats_hook()``'s."""
        out: dict[str, Any] = {"served": self.requests_served, "refused": self.requests_refused,
                               "curve": self.curve,
                               "curve_denied": self._auth.denied if self._auth else 0}
        if self.stats_hook is not None:
            out.update(self.stats_hook())
        return out

    def close(self) -> None:
        """Stop the loop and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.bulk is not None:
            self.bulk.close()
        self._thread.join(timeout=2.0)
        if self._auth is not None:  # its ZAP sockets live on our context: stop it first
            self._auth.close()
            self._auth = None
        self._ctx.term() if not self._thread.is_alive() else self._ctx.destroy(linger=0)
