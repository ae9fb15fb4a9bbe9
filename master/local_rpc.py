"""Direct RPC sockets for the master: a Unix-domain stream socket for
same-host clients and a raw TCP socket for the others.

A ZeroMQ round trip crosses four threads (client app -> client I/O thread ->
master I/O thread -> master loop, and back); on a loaded 2-core host that is
~100 µs, ~45 µs idle. A Unix stream socket served directly from the master's
poll loop crosses two (~12 µs measured here). A put is two round trips
(PUT_START, PUT_END), so this is most of a small put's latency.

Wire format: the master's own request/reply frames (the same bytes as over
ZeroMQ, see :mod:`kvpool.core.protocol`), each prefixed with its length as
4 bytes little-endian. One connection carries one request at a time per client
(:class:`~kvpool.core.rpc_client.MasterClient` holds a lock).

Across hosts the same framing is served on a TCP port of the master's bind
address (``rpc_tcp``): a ZeroMQ round trip crosses the same four threads plus
the network, and on a loaded host each thread hop costs more than the link
(cross-host 4 KiB put: two master round trips of ~170-200 µs over ZeroMQ on a
link with a 30 µs raw round trip).

Discovery: ``Op.LOCAL_ENDPOINT`` over ZeroMQ answers ``{path, instance,
tcp_port}``; the client connects to ``path`` (same host) or to ``tcp_port``
on the master's host (another host), repeats the op over that socket, and
uses it only when the ``instance`` matches (the same master process). Access:
the Unix socket file's mode (0600: the master's user only); the TCP port
carries exactly what the ZeroMQ socket without CURVE carries (data access
still needs the capabilities the master signs). Neither is opened when CURVE
is on: the ZeroMQ socket is then the only way in (``local_socket: auto``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvpool.core.errors import ErrorCode
from kvpool.core.local_socket import default_socket_path, remove_stale_socket
from kvpool.core.protocol import LOCAL_FRAME_HEADER as HEADER
from kvpool.core.protocol import encode_error
from kvpool.master.poller import LoopPoller
from kvpool.master.sockio import recv_some, send_some

__all__ = ["LocalRpcServer", "default_socket_path"]

log = logging.getLogger(__name__)

_RECV = 256 << 10  # read buffer (recv(n) would allocate n bytes per call)
_MAX_OUT = 256 << 20  # a client that does not read its replies is dropped
_MAX_CONNS = 4096
# plain ints: enum arithmetic costs ~1 µs per operation on the hot path
_POLLIN, _POLLOUT, _POLLERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    closing: bool = False  # answered a frame it cannot resync past: close after the reply
    polling_out: bool = False  # registered for POLLOUT (replies queued)


class LocalRpcServer:
    """The listening socket and its connections, driven by the master loop.

    ``register(poller)`` adds the listener to the loop's poller;
    ``serve(events, handle, too_many, limit)`` accepts, reads and answers
    every complete request among the poll events, returning the replies
    (sent by ``send_all`` once the journal is committed, as for ZeroMQ).
    ``close()`` closes everything and unlinks the path.
    """

    def __init__(self, path: str | None, max_frame_size: int,
                 tcp_host: str | None = None) -> None:
        """Listen on the Unix socket ``path`` (None: none) and, with
        ``tcp_host``, on an ephemeral TCP port of that address (``tcp_port``)."""
        self.path = path or ""
        self.max_frame = max_frame_size
        self.instance = uuid.uuid4().hex
        self._poller: LoopPoller | None = None
        self._conns: dict[int, _Conn] = {}
        self.requests = 0
        self._rbuf = bytearray(_RECV)
        self._rview = memoryview(self._rbuf)
        self._listeners: dict[int, socket.socket] = {}
        self._tcp_fds: set[int] = set()
        self.tcp_port = 0
        try:
            if path:
                self._listen_unix(path)
            if tcp_host is not None:
                self._listen_tcp(tcp_host)
        except BaseException:
            for lst in self._listeners.values():
                lst.close()
            raise

    def _listen_unix(self, path: str) -> None:
        self._claim_path(path)
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # the socket file is created 0600
            try:
                lst.bind(path)
            finally:
                os.umask(old)
            lst.listen(128)
            lst.setblocking(False)
        except BaseException:
            lst.close()
            raise
        self._listeners[lst.fileno()] = lst

    def _listen_tcp(self, host: str) -> None:
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lst = socket.socket(family, socket.SOCK_STREAM)
        try:
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lst.bind((host, 0))
            lst.listen(128)
            lst.setblocking(False)
        except BaseException:
            lst.close()
            raise
        self.tcp_port = lst.getsockname()[1]
        self._listeners[lst.fileno()] = lst
        self._tcp_fds.add(lst.fileno())

    @staticmethod
    def _claim_path(path: str) -> None:
        """Remove a stale socket file; refuse to take a live master's."""
        if not remove_stale_socket(path):
            raise OSError(errno.EADDRINUSE, f"another master serves {path}")

    def register(self, poller: LoopPoller) -> None:
        self._poller = poller
        for fd in self._listeners:
            poller.register(fd, zmq.POLLIN)

    def _close_conn(self, fd: int) -> None:
        c = self._conns.pop(fd, None)
        if c is None:
            return
        if self._poller is not None:
            self._poller.unregister(fd)
        c.sock.close()

    def _accept(self, lfd: int) -> None:
        listener = self._listeners[lfd]
        tcp = lfd in self._tcp_fds
        while True:
            try:
                s, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("local rpc accept: %s", exc)
                return
            if len(self._conns) >= _MAX_CONNS:
                s.close()
                continue
            s.setblocking(False)
            if tcp:  # replies are small and latency-bound
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = s.fileno()
            self._conns[fd] = _Conn(s)
            if self._poller is not None:
                self._poller.register(fd, zmq.POLLIN)

    def serve(self, events: list[tuple[Any, int]], handle: Callable[[bytes], bytes],
              too_many: Callable[[bytes], bytes], limit: int) -> list[tuple[_Conn, bytes]]:
        """Handle this poll round's events; return ``(conn, reply)`` pairs."""
        out: list[tuple[_Conn, bytes]] = []
        for fd, ev in events:
            if type(fd) is not int:
                continue  # a ZeroMQ socket: the loop drains those itself
            if fd in self._listeners:
                self._accept(fd)
                continue
            c = self._conns.get(fd)
            if c is None:
                continue
            if ev & _POLLOUT:
                self._flush(fd, c)
            if ev & _POLLIN:
                got = recv_some(c.sock, self._rbuf)
                if got < 0:
                    continue
                if not got:
                    self._close_conn(fd)
                    continue
                if c.closing:
                    continue
                if not c.inbuf and got > HEADER and limit > 0 \
                        and HEADER + int.from_bytes(self._rview[:HEADER], "little") == got \
                        and got - HEADER <= self.max_frame:
                    # exactly one whole frame (the common case): no buffering
                    self.requests += 1
                    out.append((c, handle(bytes(self._rview[HEADER:got]))))
                    continue
                c.inbuf += self._rview[:got]
                n = 0
                buf = c.inbuf
                while len(buf) >= HEADER:
                    size = int.from_bytes(buf[:HEADER], "little")
                    if size > self.max_frame:
                        # cannot resync past a frame we refuse to buffer: answer, then drop
                        out.append((c, too_large(size)))
                        buf.clear()
                        c.closing = True
                        break
                    if len(buf) < HEADER + size:
                        break
                    payload = bytes(buf[HEADER:HEADER + size])
                    del buf[:HEADER + size]
                    n += 1
                    self.requests += 1
                    out.append((c, handle(payload) if n <= limit else too_many(payload)))
            elif ev & _POLLERR:
                self._close_conn(fd)
        return out

    def _flush(self, fd: int, c: _Conn) -> None:
        sent = send_some(c.sock, c.outbuf)
        if sent < 0:
            self._close_conn(fd)
            return
        del c.outbuf[:sent]
        want = bool(c.outbuf)
        if want != c.polling_out and self._poller is not None and fd in self._conns:
            # ask for POLLOUT only while replies are queued (modify re-registers)
            self._poller.modify(fd, _POLLIN | (_POLLOUT if want else 0))
            c.polling_out = want

    def send_all(self, replies: list[tuple[_Conn, bytes]]) -> None:
        """Queue and send the replies (non-blocking; the rest goes on POLLOUT)."""
        touched: dict[int, _Conn] = {}
        conns = self._conns
        for c, reply in replies:
            fd = c.sock.fileno()
            if fd < 0 or conns.get(fd) is not c:
                continue  # closed meanwhile
            out = c.outbuf
            if not out and not c.closing:
                # nothing queued (the common case): one send, no buffering
                frame = len(reply).to_bytes(HEADER, "little") + reply
                sent = send_some(c.sock, frame)
                if sent < 0:
                    self._close_conn(fd)
                    continue
                if sent == len(frame):
                    continue
                out += memoryview(frame)[sent:]  # the rest goes on POLLOUT (below)
            else:
                out += len(reply).to_bytes(HEADER, "little")
                out += reply
            touched[fd] = c
        for fd, c in touched.items():
            had_out = len(c.outbuf)
            self._flush(fd, c)
            if c.closing:
                self._close_conn(fd)
            elif fd in self._conns and len(c.outbuf) > _MAX_OUT:
                log.warning("local rpc: client not reading %d bytes of replies; dropped",
                            had_out)
                self._close_conn(fd)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        for fd in list(self._conns):
            self._close_conn(fd)
        for fd, lst in self._listeners.items():
            if self._poller is not None:
                try:
                    self._poller.unregister(fd)
                except KeyError:
                    pass
            lst.close()
        self._listeners.clear()
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def too_large(size: int) -> bytes:
    """The reply to a frame above ``max_frame_size`` (its id is unknown)."""
    return encode_error(None, ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {size} bytes exceeds the limit")
