"""The journal stream's two transports: a plain TCP socket served on the
leader's loop, or ZeroMQ (ROUTER -> DEALER, needed for CURVE).

Both carry the same messages (:mod:`.replication`: a msgpack header
``[MsgType, ...]`` and, for a batch, the journal frames as a second part);
only how they travel differs.

**Socket** (endpoint ``socket://HOST:PORT``, the default where CURVE is off
for the replication address): the leader accepts standbys on its replication
port and reads and writes their connections from its own loop (one
``epoll`` that the loop's poller watches, as it watches the direct RPC
sockets of :mod:`kvpool.master.local_rpc`); a standby reads its connection
from its own loop. A group commit's round trip to an in-sync standby then
wakes two threads (the standby's loop, then the leader's) instead of six
(each side's ZeroMQ I/O thread and loop, there and back). Framing: every
message is ``u32 header length | u32 body length`` (little-endian), the
header, the body (empty except for batches). Sends never block the loop:
what the kernel does not take waits in the connection's buffer and goes on
``EPOLLOUT``; a standby that lets more than ``_MAX_BACKLOG`` wait is
dropped (it says hello again and gets a tail or a snapshot). Access: the
replication port carries what a ZeroMQ socket without CURVE carries.

**ZeroMQ** (endpoint ``tcp://HOST:PORT``): where CURVE applies (CURVE is a
ZeroMQ mechanism), or with ``replication_transport: zmq``.
"""

from __future__ import annotations

import collections
import errno
import logging
import select
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import zmq

from kvpool.core.auth import CurveAuthenticator, CurveConfig
from kvpool.master.sockio import recv_some, send_some

__all__ = [
    "SOCKET_SCHEME",
    "LeaderTransport",
    "SocketLeader",
    "SocketStandby",
    "StandbyTransport",
    "ZmqLeader",
    "ZmqStandby",
    "host_of",
    "listen_tcp",
]

log = logging.getLogger(__name__)

#: the scheme of a leader's endpoint served by :class:`SocketLeader`
SOCKET_SCHEME = "socket://"
_PREFIX = struct.Struct("<II")  # header length, body length
_PREFIX_LEN = _PREFIX.size
_pack_prefix = _PREFIX.pack
_unpack_prefix = _PREFIX.unpack_from
#: a standby's messages (hello, ack, refusal) are small: anything larger is
#: not a standby of this protocol (a ZeroMQ peer's greeting reads as ~16 MiB)
_MAX_FROM_STANDBY = 64 << 10
_MAX_FROM_LEADER = 1 << 30  # one message: a snapshot slice or merged batches
#: bytes a standby may leave unread before the leader drops its connection
_MAX_BACKLOG = 1 << 30
_RECV = 256 << 10
# plain ints: enum arithmetic costs ~1 us per operation on the loop
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_EPOLLIN = select.EPOLLIN
_EPOLLOUT = select.EPOLLOUT
_EPOLLERR = select.EPOLLERR | select.EPOLLHUP


def host_of(endpoint: str) -> str:
    """``scheme://HOST:PORT`` (or ``HOST:PORT``) -> HOST (brackets of IPv6 removed)."""
    return endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def _addr_of(endpoint: str) -> tuple[str, int]:
    rest = endpoint.split("://", 1)[-1]
    host, port = rest.rsplit(":", 1)
    return host.strip("[]"), int(port)


def listen_tcp(host: str, port: int, backlog: int = 64) -> socket.socket:
    """A TCP listener on ``host:port`` (0: a free port; ``*`` or empty: every
    address). SO_REUSEADDR: the connections a killed earlier run left in
    TIME_WAIT do not block the port."""
    name = None if host in ("", "*") else host.strip("[]")
    family, kind, proto, _, addr = socket.getaddrinfo(
        name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


# ================================================================ interfaces
class LeaderTransport(Protocol):
    """The leader's end: standbys connect; messages to and from each
    (``peer``: an opaque handle, valid until that connection is gone)."""

    endpoint: str

    @property
    def pollable(self) -> Any:
        """What the loop's poller (LoopPoller) watches (POLLIN: something to do): a
        ZeroMQ socket, or a file descriptor (an int: the poller reports it so;
        compare with ``==``)."""

    def send(self, peer: Any, header: bytes, body: bytes = b"") -> None:
        """Queue one message for ``peer``; never blocks (a gone peer: dropped)."""

    def recv_all(self) -> list[tuple[Any, bytes]]:
        """Every whole message that arrived, with its peer (non-blocking)."""

    def backlog(self, peer: Any) -> int:
        """Bytes queued for ``peer`` that the kernel has not taken yet."""

    def drop(self, peer: Any) -> None:
        """Close ``peer``'s connection (it was replaced or refused)."""

    @property
    def drops(self) -> int:
        """Connections closed so far (by :meth:`drop`, or because the peer
        closed its end or the connection failed): when it moves, look for
        peers that are :meth:`gone`."""

    def gone(self, peer: Any) -> bool:
        """``peer``'s connection is closed (ZeroMQ cannot tell: False)."""

    def wait(self, timeout_ms: int) -> bool:
        """Block up to ``timeout_ms`` for something to do."""

    def close(self) -> None: ...


class StandbyTransport(Protocol):
    """A standby's end: one connection to the leader."""

    #: set when the connection is gone (the standby dials again)
    dropped: bool

    @property
    def pollable(self) -> Any: ...

    def send(self, data: bytes) -> None: ...

    def flush(self) -> None:
        """Send what waits (a hello sent before the connection was up)."""

    def recv(self) -> list[bytes] | None:
        """The next message (``[header]`` or ``[header, body]``), None if none is whole yet."""

    @property
    def buffered(self) -> bool:
        """Whole messages were read and not taken yet (no poll reports them)."""

    def wait(self, timeout_ms: int) -> bool: ...

    def close(self) -> None: ...


# ================================================================ ZeroMQ
class ZmqLeader:
    """A ROUTER socket (a CURVE server behind the ZAP allow-list when
    ``curve`` is active for the bind address)."""

    def __init__(self, ctx: zmq.Context[Any], bind: str, curve: CurveConfig | None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a slow standby is dropped from sync, not blocked
        self._auth: CurveAuthenticator | None = None
        try:
            if curve is not None:
                self._auth = curve.setup_server(self.sock, host_of(bind))
            if bind.endswith(":0"):
                port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.endpoint = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                self.sock.bind(bind)
                self.endpoint = bind
        except BaseException:
            self.close()
            raise
        self._send = self.sock.send_multipart

    @property
    def pollable(self) -> Any:
        return self.sock

    def send(self, peer: Any, header: bytes, body: bytes = b"") -> None:
        try:
            self._send([peer, header, body] if body else [peer, header], _NOBLOCK)
        except zmq.ZMQError:
            pass  # gone: it will say hello again

    def recv_all(self) -> list[tuple[Any, bytes]]:
        out: list[tuple[Any, bytes]] = []
        sock = self.sock
        while cast(int, sock.get(_EVENTS)) & _POLLIN:
            frames = sock.recv_multipart(_NOBLOCK)
            if len(frames) == 2:
                out.append((frames[0], frames[1]))
        return out

    def backlog(self, peer: Any) -> int:
        return 0  # ZeroMQ queues without a bound (SNDHWM 0)

    def drop(self, peer: Any) -> None:
        pass  # ROUTER: a stale identity's messages are dropped

    drops = 0  # a ROUTER does not tell when a peer goes

    def gone(self, peer: Any) -> bool:
        return False

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def close(self) -> None:
        self.sock.close(0)
        if self._auth is not None:
            self._auth.close()
            self._auth = None


class ZmqStandby:
    """A DEALER socket (a CURVE client where CURVE is active for the leader's host)."""

    dropped = False  # ZeroMQ reconnects on its own

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, curve: CurveConfig | None) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.setup_client(sock, host_of(endpoint))
        sock.connect(endpoint if "://" in endpoint else f"tcp://{endpoint}")
        self.sock = sock

    @property
    def pollable(self) -> Any:
        return self.sock

    @property
    def buffered(self) -> bool:
        return False  # zmq_poll reports every queued message

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def flush(self) -> None:
        pass  # ZeroMQ's I/O thread sends

    def recv(self) -> list[bytes] | None:
        if cast(int, self.sock.get(_EVENTS)) & _POLLIN:
            return self.sock.recv_multipart(_NOBLOCK)
        return None

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def close(self) -> None:
        self.sock.close(0)


# ================================================================ plain socket
@dataclass(eq=False)
class _Peer:
    sock: socket.socket
    fd: int
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    outpos: int = 0  # what the kernel took of outbuf (compacted now and then, not per send)
    closed: bool = False


class SocketLeader:
    """Standby connections on a TCP listener, served from the leader's loop
    through one ``epoll`` (:attr:`pollable`). ``listener``: a listening
    socket to serve (the instance's held replication port; left open by
    :meth:`close`), else one is bound on ``bind`` (``socket://HOST:PORT``)
    and closed with the transport."""

    def __init__(self, bind: str, listener: socket.socket | None = None) -> None:
        self._own_listener = listener is None
        if listener is None:
            host, port = _addr_of(bind)
            listener = listen_tcp(host, port)
        self.listener = listener
        listener.setblocking(False)
        lhost, lport = listener.getsockname()[:2]
        bhost = host_of(bind) if bind else lhost
        self.endpoint = f"{SOCKET_SCHEME}{_fmt_host(bhost)}:{lport}"
        self._ep = select.epoll()
        self._ep_fd = self._ep.fileno()
        self._lfd = listener.fileno()
        self._ep.register(self._lfd, _EPOLLIN)
        self._peers: dict[int, _Peer] = {}
        self._rbuf = bytearray(_RECV)
        self._rview = memoryview(self._rbuf)
        self.accepted = 0
        self.drops = 0

    @property
    def pollable(self) -> Any:
        return self._ep_fd  # the poller reports a plain fd as the int, whatever was registered

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("replication accept: %s", exc)
                return
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = s.fileno()
            self._peers[fd] = _Peer(s, fd)
            self._ep.register(fd, _EPOLLIN)
            self.accepted += 1

    def drop(self, peer: Any) -> None:
        p = cast(_Peer, peer)
        if p.closed:
            return
        p.closed = True
        self.drops += 1
        if self._peers.get(p.fd) is p:
            del self._peers[p.fd]
            try:
                self._ep.unregister(p.fd)
            except OSError:
                pass
        p.sock.close()
        p.outbuf = bytearray()
        p.outpos = 0

    def send(self, peer: Any, header: bytes, body: bytes = b"") -> None:
        p = cast(_Peer, peer)
        if p.closed:
            return
        prefix = _pack_prefix(len(header), len(body))
        out = p.outbuf
        if not out:
            total = _PREFIX_LEN + len(header) + len(body)
            try:
                sent = p.sock.sendmsg((prefix, header, body) if body else (prefix, header))
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.drop(p)
                return
            if sent == total:
                return
            # the rest waits for EPOLLOUT
            whole = prefix + header + body
            out += memoryview(whole)[sent:]
            self._ep.modify(p.fd, _EPOLLIN | _EPOLLOUT)
            return
        out += prefix
        out += header
        out += body
        if len(out) - p.outpos > _MAX_BACKLOG:
            log.warning("replication: a standby left %d bytes unread; dropped (it resyncs)",
                        len(out))
            self.drop(p)

    def _flush(self, p: _Peer) -> None:
        out = p.outbuf
        view = memoryview(out)[p.outpos:]
        sent = send_some(p.sock, view)
        view.release()  # the bytearray may be resized again
        if not sent:
            return
        if sent < 0:
            self.drop(p)
            return
        p.outpos += sent
        if p.outpos == len(out):
            out.clear()
            p.outpos = 0
            self._ep.modify(p.fd, _EPOLLIN)
        elif p.outpos > (4 << 20) and p.outpos > len(out) // 2:
            # compacted once half is sent: a large backlog is not moved per send
            del out[:p.outpos]
            p.outpos = 0

    def backlog(self, peer: Any) -> int:
        p = cast(_Peer, peer)
        return len(p.outbuf) - p.outpos

    def gone(self, peer: Any) -> bool:
        return cast(_Peer, peer).closed

    def recv_all(self) -> list[tuple[Any, bytes]]:
        out: list[tuple[Any, bytes]] = []
        peers = self._peers
        for fd, ev in self._ep.poll(0):
            if fd == self._lfd:
                self._accept()
                continue
            p = peers.get(fd)
            if p is None:
                continue
            if ev & _EPOLLOUT:
                self._flush(p)
                if p.closed:
                    continue
            if ev & (_EPOLLIN | _EPOLLERR):
                self._read(p, out)
        return out

    def _read(self, p: _Peer, out: list[tuple[Any, bytes]]) -> None:
        got = recv_some(p.sock, self._rbuf)
        if got < 0:
            return
        if not got:
            self.drop(p)
            return
        buf = p.inbuf
        buf += self._rview[:got]
        pos = 0
        n = len(buf)
        while n - pos >= _PREFIX_LEN:
            hlen, blen = _unpack_prefix(buf, pos)
            if hlen + blen > _MAX_FROM_STANDBY or blen:
                log.warning("replication: a peer sent a message of %d + %d bytes, not a "
                            "standby's: dropped", hlen, blen)
                self.drop(p)
                return
            end = pos + _PREFIX_LEN + hlen
            if end > n:
                break
            out.append((p, bytes(buf[pos + _PREFIX_LEN:end])))
            pos = end
        if pos:
            del buf[:pos]

    def wait(self, timeout_ms: int) -> bool:
        return bool(self._ep.poll(timeout_ms / 1000, 1)) if timeout_ms else \
            bool(self._ep.poll(0, 1))

    def close(self) -> None:
        for p in list(self._peers.values()):
            self.drop(p)
        self._ep.close()
        if self._own_listener:
            self.listener.close()


class SocketStandby:
    """One connection to a :class:`SocketLeader`, read from the standby's loop.
    The connect does not block: what is sent before it completes waits in a
    buffer; a refused or broken connection sets :attr:`dropped`."""

    def __init__(self, endpoint: str, on_drop: Callable[[], None] | None = None) -> None:
        host, port = _addr_of(endpoint)
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
        self.sock = socket.socket(family, kind, proto)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fd = self.sock.fileno()
        self.dropped = False
        self._on_drop = on_drop
        self._out = bytearray()
        self._in = bytearray()
        self._pos = 0  # start of the first message not taken in _in
        self._rbuf = bytearray(_RECV)
        self._rview = memoryview(self._rbuf)
        self._ready: collections.deque[list[bytes]] = collections.deque()
        err = self.sock.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self._drop()

    @property
    def pollable(self) -> Any:
        # the poller reports a plain fd as the int; None once dropped (the
        # socket is closed: the caller stops polling it)
        return None if self.dropped else self._fd

    @property
    def buffered(self) -> bool:
        return bool(self._ready)

    def _drop(self) -> None:
        if not self.dropped:
            self.dropped = True
            self.sock.close()  # else its EOF would keep the caller's poll awake
            if self._on_drop is not None:
                self._on_drop()

    def send(self, data: bytes) -> None:
        if self.dropped:
            return
        self._out += _pack_prefix(len(data), 0)
        self._out += data
        self._flush()

    def flush(self) -> None:
        if self._out:
            self._flush()

    def _flush(self) -> None:
        out = self._out
        if not out or self.dropped:
            return
        sent = send_some(self.sock, out)
        if sent < 0:
            self._drop()
            return
        del out[:sent]  # (0: not connected yet, or the kernel's buffer is full)

    def recv(self) -> list[bytes] | None:
        if self._out:
            self._flush()
        ready = self._ready
        if ready:
            return ready.popleft()
        if self.dropped:
            return None
        while True:
            got = recv_some(self.sock, self._rbuf)
            if got < 0:
                return None
            if not got:
                self._drop()
                return None
            self._parse(got)
            if ready:
                return ready.popleft()

    def _parse(self, got: int) -> None:
        buf = self._in
        buf += self._rview[:got]
        pos = self._pos
        n = len(buf)
        ready = self._ready
        while n - pos >= _PREFIX_LEN:
            hlen, blen = _unpack_prefix(buf, pos)
            if hlen + blen > _MAX_FROM_LEADER:
                log.error("replication: a message of %d + %d bytes from the leader: "
                          "connection dropped", hlen, blen)
                self._drop()
                break
            h0 = pos + _PREFIX_LEN
            end = h0 + hlen + blen
            if end > n:
                break
            h1 = h0 + hlen
            ready.append([bytes(buf[h0:h1]), bytes(buf[h1:end])] if blen
                         else [bytes(buf[h0:h1])])
            pos = end
        if pos == n:
            buf.clear()
            pos = 0
        elif pos > (1 << 20) and pos > n // 2:
            del buf[:pos]
            pos = 0
        self._pos = pos

    def wait(self, timeout_ms: int) -> bool:
        if self._ready:
            return True
        if self.dropped:
            return False
        p = select.poll()
        p.register(self.sock, select.POLLIN)
        return bool(p.poll(timeout_ms))

    def close(self) -> None:
        self.dropped = True
        self.sock.close()


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
