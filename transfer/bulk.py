"""Plain-TCP bulk path of the ``tcp`` transport: payloads land in place, many
ranges per round trip.

Over ZeroMQ every payload is copied once more than over a raw socket (the
receiving I/O thread reads it into a ZeroMQ message, the application copies
that into the segment or buffer), and every message crosses two more threads:
on a 2-core host a ZeroMQ round trip cost 68 µs p50 where a plain socket took
22 µs. This path reads straight into the destination (``recvmsg_into`` the
segment / buffer slices), sends straight from the source (``sendmsg`` of the
slices), and carries a whole run of ranges in one header
(:class:`~kvpool.transfer.wire.BulkRequest`), so a batch of small requests
costs one header, one syscall per direction and one round trip.

It sits beside the :class:`~kvpool.transfer.server.TransferServer` (the same
per-range validation — ownership, op, bounds, size limit, capability — before
any byte moves) and is only offered when the transfer server runs without
CURVE; a client with CURVE active for the peer never uses it. Peers find its
port with the transfer server's ``ServerOp.BULK`` request. Stream format: see
:mod:`kvpool.transfer.wire`. A refused range of a WRITE has its payload read
and dropped so the stream stays in step; a header that does not decode closes
the connection.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from kvpool.core import spin as _spin
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer import wire
from kvpool.transfer.transports.base import report_done
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["BulkClient", "BulkServer", "RangeValidator", "set_congestion"]

log = logging.getLogger(__name__)

_HDR = wire.BULK_FRAME_HEADER
_MAX_CONNS = 64
_IDLE_S = 300.0  # a silent connection is closed after this long
_DISCARD = 1 << 20  # scratch for the payloads of refused WRITE ranges
_IOV_MAX = 512  # buffers per sendmsg / recvmsg_into (Linux allows 1024)
_MAX_ITEMS = 256  # ranges per request
_REPLY_MAX = 1 << 16  # largest reply header a client accepts
_RBUF = 1 << 17  # read buffer of a connection (holds any accepted header)
# bytes one read asks for beyond what the header needs: a header and a small
# payload arrive in one syscall, while a large payload is left in the socket to
# be received straight into its destination (reading it through the buffer
# halved 1 MiB READs on loopback: one more copy, and the sender stalls meanwhile)
_FILL = 16 << 10
_LARGE = 256 << 10  # a piece this large is sent / received on its own (no iovec)
# a client polls for the reply to a small request (one request of at most
# _SPIN_BYTES of payload) for up to _SPIN_S before it sleeps in recv: the reply
# to a 4 KiB put or get comes ~100 µs after the request, and on a busy host
# waking a sleeping thread added tens of µs to that. The poll yields the CPU
# between tries (a late yield, on a busy CPU, stops the polls of the process for
# a while: core/spin.py), and a connection polls only while its small replies
# have of late come within the window (a moving average): later ones would only
# burn CPU
_SPIN_S = float(os.environ.get("KVPOOL_BULK_SPIN_US", "150")) / 1e6
_SPIN_BYTES = 64 << 10
_WAITALL = socket.MSG_WAITALL
_MV = "bulk_mv"  # BufferHandle.cache key of the buffer's byte memoryview (_bytes_view)
# every frame is padded to at least this many bytes: with ~23-byte frames in
# front of each payload, 1 MiB requests over loopback ran at 0.6x of the old
# 39-byte frames here, reproducibly (raw sockets show the same with headers of
# 19 vs 39+ bytes); 64 bytes measured as fast as the old frames
_MIN_FRAME = 64
_UNSET: Any = object()
_BULK_OPS = {int(TransferOp.READ): TransferOp.READ, int(TransferOp.WRITE): TransferOp.WRITE}

#: (op, items, capability table) -> (codes, segments, first error): validates
#: and counts every range of one request; a segment (anything with ``view()``,
#: ``write_from()``, ``read_payload()``) where code is 0, None where refused.
RangeValidator = Callable[[TransferOp, list[wire.BulkItem], list[bytes]],
                          tuple[list[int], list[Any], str]]


_TCP_CONGESTION: int | None = getattr(socket, "TCP_CONGESTION", None)  # Linux only
_CC_FALLBACK = ("cubic", "reno")  # what ``auto`` moves a BBR socket to, in order
_cc_refused: set[str] = set()  # algorithms already reported as refused (warned once)


def set_congestion(sock: socket.socket, policy: str) -> str:
    """Apply a ``tcp_congestion`` policy (:class:`~kvpool.transfer.config.TransferConfig`)
    to a TCP socket; returns the algorithm it then uses ("" where unknown).

    ``auto``: a socket on BBR (any version: they pace) moves to cubic, or to
    reno, which every process may choose, where cubic is not allowed; other
    algorithms are kept. ``system``: nothing changes. A name: that algorithm.
    An algorithm the kernel refuses (not built, or not in
    ``net.ipv4.tcp_allowed_congestion_control`` for an unprivileged process)
    keeps the socket as it was, with one warning per name.
    """
    if _TCP_CONGESTION is None or policy == "system":
        return ""
    try:
        current = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16)
    except OSError:  # not TCP (a Unix socket in a test): nothing to choose
        return ""
    now = current.split(b"\0", 1)[0].decode()
    if policy == "auto":
        if not now.startswith("bbr"):
            return now
        wanted: tuple[str, ...] = _CC_FALLBACK
    else:
        wanted = (policy,)
    for name in wanted:
        if name == now:
            return now
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name.encode())
            return name
        except OSError as exc:
            if name not in _cc_refused:
                _cc_refused.add(name)
                log.warning("tcp congestion control %s refused (%s); bulk sockets keep %s "
                            "where nothing else is accepted", name, exc, now)
    return now


def _consume(views: list[Any], i: int, n: int) -> int:
    """Drop ``n`` bytes received or sent from ``views[i:]`` (trimming a view
    done in part); returns the index of the first view not yet complete."""
    while n:
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


class _Stream:
    """One TCP connection with a read buffer and deadlines.

    The socket is blocking with kernel timeouts (``SO_RCVTIMEO`` /
    ``SO_SNDTIMEO``, set to what is left until the deadline): each read or
    write is one syscall, where Python's timeout mode polls before every one
    (a blocking ``send`` queues a whole large piece in one call); a kernel
    timeout (EAGAIN) is raised as TimeoutError. Headers are read through a
    buffer: one ``recv`` usually brings the length, the header and a small
    payload, but at most ``_FILL`` bytes beyond the header, so a large payload
    stays in the socket and is received straight into its destination. Many
    small pieces go out in one ``sendmsg`` and come in with one
    ``recvmsg_into``; one large piece goes through ``send``/``recv_into``.
    (A non-blocking socket with Python-level retry loops cost 2x the system
    time per 1 MiB request here.)
    """

    def __init__(self, sock: socket.socket, max_header: int) -> None:
        sock.settimeout(None)  # blocking: _arm sets the kernel timeouts
        self.sock = sock
        self._timeout = -1.0
        self._buf = bytearray(max(_RBUF, 2 * (max_header + _HDR)))
        self._view = memoryview(self._buf)
        self._start = 0  # buffered, unread bytes: _buf[_start:_end]
        self._end = 0
        self._need = _HDR  # bytes the header being read needs in the buffer
        self.spin_until = 0.0  # perf_counter time: the next read polls until then

    def _arm(self, deadline: float) -> None:
        """Set the socket's kernel timeouts to what is left until ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if abs(left - self._timeout) > 0.05 * left:  # two syscalls: only when it moved
            # a zero timeval would mean "no timeout": at least 1 µs
            tv = struct.pack("ll", int(left), max(1, int((left % 1) * 1e6)))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._timeout = left

    def _fill(self, deadline: float) -> bool:
        """Read what has arrived into the buffer (at least one byte); False on EOF."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # make room: move the unread tail to the front
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        want = max(_FILL, self._need - (self._end - self._start))
        k = -1
        if self.spin_until:  # poll without sleeping first (see _SPIN_S)
            if _spin.polling():
                k = _spin.recv_polling(self.sock, self._view[self._end:self._end + want],
                                       self.spin_until)
            self.spin_until = 0.0
        if k < 0:
            self._arm(deadline)
            try:
                k = self.sock.recv_into(self._view[self._end:self._end + want])
            except BlockingIOError:  # SO_RCVTIMEO ran out
                raise TimeoutError from None
        if k == 0:
            return False
        self._end += k
        return True

    def read_frame(self, max_bytes: int, deadline: float) -> bytes | None:
        """One length-prefixed header; None on a clean EOF before it."""
        self._need = _HDR
        while self._end - self._start < _HDR:
            if not self._fill(deadline):
                if self._end == self._start:
                    return None
                raise KVPoolError("connection closed inside a header",
                                  ErrorCode.MALFORMED_FRAME)
        n = int.from_bytes(self._buf[self._start:self._start + _HDR], "little")
        if n > max_bytes or _HDR + n > len(self._buf):
            raise KVPoolError(f"header of {n} bytes", ErrorCode.FRAME_TOO_LARGE)
        self._need = _HDR + n
        while self._end - self._start < _HDR + n:
            if not self._fill(deadline):
                raise KVPoolError("connection closed inside a header",
                                  ErrorCode.MALFORMED_FRAME)
        raw = bytes(self._buf[self._start + _HDR:self._start + _HDR + n])
        self._start += _HDR + n
        return raw

    def read_into(self, views: list[memoryview], deadline: float) -> bool:
        """Fill every view in order: buffered bytes first, then straight from the
        socket; False on EOF."""
        views = [v for v in views if len(v)]
        i = 0
        while i < len(views) and self._start < self._end:  # what the buffer holds
            k = min(len(views[i]), self._end - self._start)
            views[i][:k] = self._view[self._start:self._start + k]
            self._start += k
            if k == len(views[i]):
                i += 1
            else:
                views[i] = views[i][k:]
        if i < len(views) and len(views) - i <= _IOV_MAX:  # the rest in one syscall, usually
            rest = views[i:]
            sizes = [len(v) for v in rest]
            want = sum(sizes)
            if max(sizes) < _LARGE:  # no large piece (those go on their own, below)
                self._arm(deadline)
                try:
                    n = self.sock.recvmsg_into(rest, 0, _WAITALL)[0]
                except BlockingIOError:  # SO_RCVTIMEO ran out
                    raise TimeoutError from None
                if n == want:
                    return True
                if n == 0:
                    return False
                i = _consume(views, i, n)  # cut short by the timeout or a signal
        while i < len(views):
            self._arm(deadline)
            try:
                # MSG_WAITALL: the kernel waits for all of it (or the timeout), so
                # a payload that arrives in several packets costs one syscall and
                # one wake-up here, not one per arrival
                if len(views[i]) >= _LARGE or i == len(views) - 1:
                    n = self.sock.recv_into(views[i], 0, _WAITALL)  # one large piece: no iovec
                else:
                    n = self.sock.recvmsg_into(views[i:i + _IOV_MAX], 0, _WAITALL)[0]
            except BlockingIOError:  # SO_RCVTIMEO ran out
                raise TimeoutError from None
            if n == 0:
                return False
            i = _consume(views, i, n)
        return True

    def write(self, bufs: list[Any], deadline: float) -> None:
        """Send every buffer in order: small ones gathered into one ``sendmsg``,
        large ones with ``send``."""
        self.write_views([memoryview(b).cast("B") for b in bufs if len(b)], deadline)

    def write_views(self, views: list[Any], deadline: float) -> None:
        """:meth:`write` of non-empty ``bytes`` or byte memoryviews, as given
        (no conversion)."""
        if not views:
            return
        try:
            self._write(views, deadline)
        except BlockingIOError:  # SO_SNDTIMEO ran out (the peer does not read)
            raise TimeoutError from None

    def _write(self, views: list[Any], deadline: float) -> None:
        if len(views) == 1 and len(views[0]) < _LARGE:  # a reply header: one send
            self._arm(deadline)
            n = self.sock.send(views[0])
            if n == len(views[0]):
                return
            views = [memoryview(views[0])[n:]]
        if len(views) <= _IOV_MAX:  # the common case: small pieces, all sent by one sendmsg
            sizes = [len(v) for v in views]
            if max(sizes, default=0) < _LARGE:
                self._arm(deadline)
                n = self.sock.sendmsg(views)
                if n == sum(sizes):
                    return
                # a partial send (socket buffer full): the general loop sends the rest
                while n:
                    if n >= len(views[0]):
                        n -= len(views.pop(0))
                    else:
                        views[0] = views[0][n:]
                        n = 0
        i = 0
        while i < len(views):
            self._arm(deadline)
            if len(views[i]) >= _LARGE:
                # one blocking send() queues it all unless the timeout cuts it
                # short; then the rest goes with a timeout re-armed to the
                # deadline (sendall would wait the full timeout once more)
                n = self.sock.send(views[i])
                if n >= len(views[i]):
                    i += 1
                else:
                    views[i] = views[i][n:]
                continue
            j = i
            while j < len(views) and j - i < _IOV_MAX and len(views[j]) < _LARGE:
                j += 1
            i = _consume(views, i, self.sock.sendmsg(views[i:j]))

    def close(self) -> None:
        self.sock.close()


def _frame(msg: wire.BulkRequest | wire.BulkReply) -> bytes:
    """``[u32 length][header]``, at least ``_MIN_FRAME`` bytes (``pad``)."""
    raw = wire.encode(msg)
    if len(raw) + _HDR < _MIN_FRAME:
        msg.pad = bytes(_MIN_FRAME - _HDR - len(raw))  # an empty pad is already encoded
        raw = wire.encode(msg)
    return len(raw).to_bytes(_HDR, "little") + raw


class BulkServer:
    """Listening socket + one thread per peer connection (at most 64).

    ``validate`` checks (and counts) the ranges of one request
    (:data:`RangeValidator`); ``count(False, n)`` records ``n`` ranges
    refused without validation (unknown op). ``congestion``: the
    ``tcp_congestion`` policy of accepted connections (:func:`set_congestion`).
    ``close()`` stops it.
    """

    def __init__(self, bind_host: str, validate: RangeValidator,
                 count: Callable[[bool, int], None], max_header_bytes: int,
                 max_request_bytes: int, congestion: str = "auto") -> None:
        self._validate = validate
        self._congestion = congestion
        self._count = count
        self.max_header_bytes = max_header_bytes
        self._max_req = max_request_bytes
        self._lst = socket.create_server((bind_host, 0))
        self._lst.settimeout(0.2)
        self.port: int = self._lst.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvpool-bulk:{self.port}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._lst.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            set_congestion(conn, self._congestion)  # before its first reply is sent
            with self._lock:
                if self._stop.is_set() or len(self._conns) >= _MAX_CONNS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                             name=f"kvpool-bulk-conn:{self.port}").start()

    def _serve_conn(self, conn: socket.socket) -> None:
        stream = _Stream(conn, self.max_header_bytes)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            scratch = memoryview(bytearray(_DISCARD))
            while not self._stop.is_set() and self._serve_one(stream, scratch):
                pass
        except (OSError, KVPoolError) as exc:
            log.debug("bulk connection closed: %s", exc)
        except Exception:  # never let one peer take the process down
            log.exception("bulk server: unexpected error")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _check(self, req: wire.BulkRequest) -> tuple[list[int], list[Any], str]:
        """Validate every range: (codes, segments (None where refused), first error)."""
        op = _BULK_OPS.get(req.op)
        if op is None:
            n = len(req.items)
            self._count(False, n)
            return ([int(ErrorCode.UNKNOWN_OP)] * n, [None] * n,
                    f"unknown op {req.op!r} on the bulk path")
        return self._validate(op, req.items, req.caps)

    def _serve_one(self, stream: _Stream, scratch: memoryview) -> bool:
        """One request; False when the connection is done (EOF, or out of step)."""
        raw = stream.read_frame(self.max_header_bytes, time.monotonic() + _IDLE_S)
        if raw is None:
            return False
        deadline = time.monotonic() + _IDLE_S
        req = wire.decode_bulk_request(raw)  # undecodable: the stream is lost, close
        codes, segs, err = self._check(req)
        if len(codes) == 1 and not codes[0]:  # one accepted range: a lone put or get
            view = segs[0].view()
            if view is not None:
                return self._serve_single(stream, req, view, deadline)
        reply = _frame(wire.BulkReply(req.id, codes, err))
        if req.op == TransferOp.WRITE:
            if None in segs and any(s is None and not 0 <= it.len <= self._max_req
                                    for it, s in zip(req.items, segs, strict=True)):
                # a refused range whose payload length cannot be trusted: the
                # stream cannot be kept in step; answer, then close
                stream.write([reply], deadline)
                return False
            if not self._receive(stream, req.items, segs, scratch, deadline):
                return False
            stream.write([reply], deadline)
        elif req.op == TransferOp.READ:
            stream.write([reply, *self._payloads(req.items, segs)], deadline)
        else:
            stream.write([reply], deadline)
        return True

    @staticmethod
    def _serve_single(stream: _Stream, req: wire.BulkRequest, view: memoryview,
                      deadline: float) -> bool:
        """:meth:`_serve_one` of a request of one accepted range on a mapped
        segment (``view``): payload straight into / out of the mapping; False
        on EOF."""
        it = req.items[0]
        n = it.len
        reply = _frame(wire.BulkReply(req.id, [0]))
        if not n:
            stream.write_views([reply], deadline)
        elif req.op == TransferOp.WRITE:
            if not stream.read_into([view[it.off:it.off + n]], deadline):
                return False
            stream.write_views([reply], deadline)
        else:
            stream.write_views([reply, view[it.off:it.off + n]], deadline)
        return True

    @staticmethod
    def _payloads(items: list[wire.BulkItem], segs: list[Any]) -> list[Any]:
        """A READ's payloads, accepted ranges only: slices of each segment's
        mapping (taken once per segment), or ``read_payload`` copies."""
        out: list[Any] = []
        mapped: dict[int, Any] = {}
        for it, seg in zip(items, segs, strict=True):
            if seg is None:
                continue
            view = mapped.get(id(seg), _UNSET)
            if view is _UNSET:
                view = mapped[id(seg)] = seg.view()
            out.append(view[it.off:it.off + it.len] if view is not None
                       else seg.read_payload(it.off, it.len))
        return out

    def _receive(self, stream: _Stream, items: list[wire.BulkItem], segs: list[Any],
                 scratch: memoryview, deadline: float) -> bool:
        """Receive a WRITE's payloads: accepted ranges straight into their
        segments, refused ones into scratch (dropped). False on EOF."""
        seg0 = segs[0] if segs else None
        if seg0 is not None and segs.count(seg0) == len(segs):  # one segment, all accepted
            view = seg0.view()
            if view is not None:
                return stream.read_into([view[it.off:it.off + it.len] for it in items], deadline)
        views: list[memoryview] = []
        staged: list[tuple[Any, int, np.ndarray]] = []  # segments without a mapping
        mapped: dict[int, Any] = {}  # id(segment) -> its view (one per segment, not per range)
        for it, seg in zip(items, segs, strict=True):
            if seg is None:
                left = it.len
                while left:
                    k = min(left, len(scratch))
                    views.append(scratch[:k])
                    left -= k
                continue
            view = mapped.get(id(seg), _UNSET)
            if view is _UNSET:
                view = mapped[id(seg)] = seg.view()
            if view is not None:
                views.append(view[it.off:it.off + it.len])
            else:
                tmp = np.empty(it.len, dtype=np.uint8)
                staged.append((seg, it.off, tmp))
                views.append(tmp.data)
        if not stream.read_into(views, deadline):
            return False
        for seg, off, tmp in staged:
            seg.write_from(off, tmp)
        return True

    def close(self) -> None:
        """Stop accepting, cut every connection, join the accept thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._lst.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)


class BulkClient:
    """One blocking connection to a peer's bulk port (used by one thread at a time).

    ``max_header`` is the largest request header the peer takes (its
    :class:`~kvpool.transfer.wire.BulkOffer`); runs of ranges are packed into
    requests below it. ``caps_table``: the peer takes a request's capability
    table (each distinct token sent once per request, items name it by index).
    ``congestion``: the ``tcp_congestion`` policy (:func:`set_congestion`).
    """

    def __init__(self, host: str, port: int, timeout: float, max_header: int = 4096,
                 caps_table: bool = False, congestion: str = "auto") -> None:
        sock = socket.create_connection((host, port), timeout=max(0.01, timeout))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_congestion(sock, congestion)
        self.stream = _Stream(sock, _REPLY_MAX)
        self.broken = False
        self.max_header = max(256, max_header)
        self.caps_table = caps_table
        self._ids = itertools.count(1)
        self._reply_wait = 0.0  # seconds: see _run_group
        self._skipped = [0]  # lone waits not polled since the last probe (_run_single)
        self._ahead: tuple[Any, int | BaseException] | None = None  # see send_ahead

    def run(self, items: Sequence[Any], deadline: float, report: Callable[..., None],
            final_codes: set[ErrorCode], now: Callable[[], float]) -> None:
        """Execute host-buffer READ/WRITE work items, pipelined per run of one
        op (a mixed run could fill both directions' socket buffers at once).
        Reports each item. Marks the client broken on a stream error or timeout,
        failing what is left (retryable)."""
        if len(items) == 1 and not self.broken:
            self._run_single(items[0], deadline, report, final_codes)
            return
        for group in _runs(items):
            if self.broken:
                for it in group:
                    report(it, TransferError("bulk connection lost", ErrorCode.TRANSFER_FAIL))
                continue
            self._run_group(group, deadline, report, final_codes, now)

    def _pack(self, items: Sequence[Any]) -> list[list[Any]]:
        """Split one run into requests whose headers stay below ``max_header``
        (with a capability table, a token counts once per request)."""
        out: list[list[Any]] = []
        cur: list[Any] = []
        size = 32
        table = self.caps_table
        seen: set[bytes] = set()  # tokens already in the current request's table
        for it in items:
            cap = it.capability
            base = len(it.segment.segment_id) * 4 + 32
            if not table:
                est = base + len(cap)
            else:
                est = base + (len(cap) + 8 if cap not in seen else 0)
            if cur and (size + est > self.max_header or len(cur) >= _MAX_ITEMS):
                out.append(cur)
                cur, size = [], 32
                seen.clear()
                est = base + len(cap) + (8 if table else 0)
            cur.append(it)
            if table:
                seen.add(cap)
            size += est
        if cur:
            out.append(cur)
        return out

    def _header(self, rid: int, op: int, part: Sequence[Any]) -> wire.BulkRequest:
        """The request header of ``part`` (tokens by index when the peer takes a table)."""
        Item = wire.BulkItem
        if not self.caps_table:
            return wire.BulkRequest(rid, op, [
                Item(it.segment.segment_id, it.offset, it.length, it.capability)
                for it in part])
        caps: list[bytes] = []
        index: dict[bytes, int] = {}
        items = []
        for it in part:
            cap = it.capability
            if cap:
                k = index.get(cap)
                if k is None:
                    k = index[cap] = len(caps)
                    caps.append(cap)
                items.append(Item(it.segment.segment_id, it.offset, it.length, k))
            else:
                items.append(Item(it.segment.segment_id, it.offset, it.length))
        return wire.BulkRequest(rid, op, items, caps=caps)

    def _requests(self, items: Sequence[Any], op: int) -> list[tuple[Sequence[Any], int, bytes]]:
        """``(ranges, id, frame)`` of each request of one run: one request when
        its header fits (the common case: no packing pass), else :meth:`_pack`'s."""
        if self.caps_table and len(items) <= _MAX_ITEMS:
            rid = next(self._ids)
            frame = _frame(self._header(rid, op, items))
            if len(frame) - _HDR <= self.max_header:
                return [(items, rid, frame)]
        out: list[tuple[Sequence[Any], int, bytes]] = []
        for part in self._pack(items):
            rid = next(self._ids)
            out.append((part, rid, _frame(self._header(rid, op, part))))
        return out

    def _run_group(self, items: Sequence[Any], deadline: float, report: Callable[..., None],
                   final_codes: set[ErrorCode], now: Callable[[], float]) -> None:
        stream = self.stream
        write = items[0].op is TransferOp.WRITE
        done = 0  # items of ``items`` reported so far, in order
        try:
            reqs = self._requests(items, int(items[0].op))
            for part, _rid, frame in reqs:  # send every request, then read every reply
                views: list[Any] = [frame]
                if write:
                    for it in part:
                        n = it.length
                        if n:
                            off = it.buffer_offset
                            views.append(_bytes_view(it.buffer)[off:off + n])
                stream.write_views(views, deadline)
            sent = 0.0
            if len(reqs) == 1 and _SPIN_S and sum(it.length for it in items) <= _SPIN_BYTES:
                sent = time.perf_counter()
                if self._reply_wait < _SPIN_S:  # replies come within the window of late
                    stream.spin_until = sent + _SPIN_S
            for part, rid, _ in reqs:
                raw = stream.read_frame(_REPLY_MAX, deadline)
                if sent:  # how long small replies take, of late: a moving average
                    # of waits capped at twice the window (one stall does not stop polls)
                    wait = min(time.perf_counter() - sent, 2 * _SPIN_S)
                    self._reply_wait += (wait - self._reply_wait) * 0.125
                rep = wire.decode_bulk_reply(raw) if raw is not None else None
                if rep is None or rep.id != rid or len(rep.codes) != len(part):
                    raise ConnectionError("bulk reply out of step")
                codes = rep.codes  # ints; 0 is OK
                refused = any(codes)
                if not write:  # the payloads of the accepted ranges follow, in order
                    dst = [_bytes_view(it.buffer)[it.buffer_offset:it.buffer_offset + it.length]
                           for it, c in zip(part, codes, strict=True) if not c] \
                        if refused else \
                        [_bytes_view(it.buffer)[it.buffer_offset:it.buffer_offset + it.length]
                         for it in part]
                    if dst and not stream.read_into(dst, deadline):
                        raise ConnectionError("peer closed the bulk connection")
                if not refused:
                    done += len(part)
                    report_done(report, part)
                    continue
                for it, c in zip(part, codes, strict=True):
                    done += 1
                    if not c:
                        report(it, None)
                    else:
                        code = self._code(c)
                        report(it, TransferError(f"peer: {rep.err}", code,
                                                 retryable=code not in final_codes))
        except TimeoutError:
            self._fail(items[done:], report, "no reply before the deadline", ErrorCode.TIMEOUT)
        except (OSError, ConnectionError, KVPoolError, ValueError) as exc:
            self._fail(items[done:], report, f"bulk connection: {exc}", ErrorCode.TRANSFER_FAIL)

    def send_ahead(self, it: Any, deadline: float) -> None:
        """Send the request of the lone item ``it`` now; the next ``run([it])``
        reads its reply instead of sending it (the stripes of a large READ go
        out together from one thread, so the peer starts serving each at once
        rather than when the thread that receives it gets to run). A failure to
        send is reported by that ``run``, as it would have been there."""
        try:
            self._ahead = (it, self._send_single(it, deadline))
        except Exception as exc:  # raised again where run() would have met it
            self._ahead = (it, exc)

    def _send_single(self, it: Any, deadline: float) -> int:
        """Send the request (and a WRITE's payload) of one item; returns its id."""
        rid = next(self._ids)
        n = it.length
        cap = it.capability
        if self.caps_table and cap:
            req = wire.BulkRequest(rid, int(it.op),
                                   [wire.BulkItem(it.segment.segment_id, it.offset, n, 0)],
                                   caps=[cap])
        else:
            req = wire.BulkRequest(rid, int(it.op),
                                   [wire.BulkItem(it.segment.segment_id, it.offset, n, cap)])
        if it.op is TransferOp.WRITE and n:
            off = it.buffer_offset
            self.stream.write_views([_frame(req), _bytes_view(it.buffer)[off:off + n]], deadline)
        else:
            self.stream.write_views([_frame(req)], deadline)
        return rid

    def _run_single(self, it: Any, deadline: float, report: Callable[..., None],
                    final_codes: set[ErrorCode]) -> None:
        """:meth:`_run_group` of one item (a lone put or get): the same request,
        reply checks, reply poll and reports, without the packing pass and the
        per-item loops."""
        stream = self.stream
        n = it.length
        write = it.op is TransferOp.WRITE
        ahead, self._ahead = self._ahead, None
        try:
            if ahead is not None and ahead[0] is it:  # sent by send_ahead
                if isinstance(ahead[1], BaseException):
                    raise ahead[1]
                rid = ahead[1]
            else:
                rid = self._send_single(it, deadline)
            sent = 0.0
            polled = False
            if _SPIN_S and n <= _SPIN_BYTES:
                sent = time.perf_counter()
                # see _run_group; a shut gate still polls now and then, and a
                # wait slept through counts as the window (core/spin.py)
                if _spin.polling() and (self._reply_wait < _SPIN_S
                                        or _spin.probe(self._skipped, 0)):
                    polled = True
                    stream.spin_until = sent + _SPIN_S
            raw = stream.read_frame(_REPLY_MAX, deadline)
            if sent:
                wait = _spin.wait_sample(time.perf_counter() - sent, polled, _SPIN_S)
                self._reply_wait += (wait - self._reply_wait) * 0.125
            rep = wire.decode_bulk_reply(raw) if raw is not None else None
            if rep is None or rep.id != rid or len(rep.codes) != 1:
                raise ConnectionError("bulk reply out of step")
            c = rep.codes[0]
            if c:
                code = self._code(c)
                report(it, TransferError(f"peer: {rep.err}", code,
                                         retryable=code not in final_codes))
                return
            if not write and n:
                off = it.buffer_offset
                if not stream.read_into([_bytes_view(it.buffer)[off:off + n]], deadline):
                    raise ConnectionError("peer closed the bulk connection")
        except TimeoutError:
            self._fail([it], report, "no reply before the deadline", ErrorCode.TIMEOUT)
            return
        except (OSError, ConnectionError, KVPoolError, ValueError) as exc:
            self._fail([it], report, f"bulk connection: {exc}", ErrorCode.TRANSFER_FAIL)
            return
        report(it, None)

    @staticmethod
    def _code(code: int) -> ErrorCode:
        try:
            return ErrorCode(code)
        except ValueError:
            return ErrorCode.INTERNAL_ERROR

    def _fail(self, items: Sequence[Any], report: Callable[..., None], why: str,
              code: ErrorCode) -> None:
        self.broken = True
        for it in items:
            report(it, TransferError(why, code))

    def close(self) -> None:
        self.stream.close()


def _bytes_view(buf: Any) -> memoryview:
    """A byte memoryview of a host buffer, made once per buffer (kept in its
    ``cache``): slicing it is cheaper than a numpy view per range plus a cast."""
    mv = buf.cache.get(_MV)
    if mv is None:
        mv = buf.cache[_MV] = memoryview(buf.host_view()).cast("B")
    return cast(memoryview, mv)


def _runs(items: Sequence[Any]) -> list[Sequence[Any]]:
    """Consecutive items of one op."""
    out: list[Sequence[Any]] = []
    i = 0
    while i < len(items):
        j = i
        while j < len(items) and items[j].op is items[i].op:
            j += 1
        out.append(items[i:j])
        i = j
    return out
