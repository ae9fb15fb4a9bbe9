"""Plain-TCP bulk path of the ``tcp`` transport: the stream both ends speak.

Over ZeroMQ every payload is copied once more than over a raw socket (the
receiving I/O thread reads it into a ZeroMQ message, the application copies
that into the segment or buffer), and every message crosses two more threads.
The bulk path reads straight into the destination (``recvmsg_into`` the
segment / buffer slices), sends straight from the source (``sendmsg`` of the
slices), and carries a whole run of ranges in one header
(:class:`~kvpool.transfer.wire.BulkRequest`), so a batch of small requests
costs one header, one syscall per direction and one round trip.

This module holds what both ends share: the connection with its read buffer
and kernel deadlines (:class:`BulkStream`), the framing of headers
(:func:`bulk_frame`) and the congestion-control policy of the sockets
(:func:`set_congestion`). The holder's end is
:class:`~kvpool.transfer.bulk_server.BulkServer` (it sits beside the
:class:`~kvpool.transfer.server.TransferServer` and is only offered when that
server runs without CURVE), the requester's
:class:`~kvpool.transfer.bulk_client.BulkClient`. Peers find the port with the
transfer server's ``ServerOp.BULK`` request or in a segment descriptor's
``extra["bulk"]``. Stream format: see :mod:`kvpool.transfer.wire`.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Any

from kvpool.core import spin as _spin
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer import wire

__all__ = ["BulkStream", "bulk_frame", "set_congestion"]

log = logging.getLogger(__name__)

_HDR = wire.BULK_FRAME_HEADER
_IOV_MAX = 512  # buffers per sendmsg / recvmsg_into (Linux allows 1024)
_RBUF = 1 << 17  # read buffer of a connection (holds any accepted header)
# bytes one read asks for beyond what the header needs: a header and a small
# payload arrive in one syscall, while a large payload is left in the socket to
# be received straight into its destination (reading it through the buffer costs
# one more copy, and the sender stalls meanwhile)
_FILL = 16 << 10
_LARGE = 256 << 10  # a piece this large is sent / received on its own (no iovec)
_WAITALL = socket.MSG_WAITALL
# every frame is padded to at least this many bytes: short frames in front of
# each payload made large requests over loopback markedly slower, reproducibly
# (raw sockets show the same); 64 bytes measured as fast as longer frames
_MIN_FRAME = 64


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


class BulkStream:
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
    (A non-blocking socket with Python-level retry loops cost markedly more
    system time per large request.)
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
        self.arrived = 0.0  # perf_counter time the last header was read in full

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
        if self.spin_until:  # poll without sleeping first (see BulkClient.spin_s)
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
        self.arrived = time.perf_counter()
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


def bulk_frame(msg: wire.BulkRequest | wire.BulkReply) -> bytes:
    """``[u32 length][header]``, at least ``_MIN_FRAME`` bytes (``pad``)."""
    raw = wire.encode(msg)
    if len(raw) + _HDR < _MIN_FRAME:
        msg.pad = bytes(_MIN_FRAME - _HDR - len(raw))  # an empty pad is already encoded
        raw = wire.encode(msg)
    return len(raw).to_bytes(_HDR, "little") + raw
