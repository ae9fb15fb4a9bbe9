"""Client-side RPC stub for the master (used by the store, tooling and tests).

Thread-safe: one DEALER socket guarded by a lock; every call has a timeout.
A timed-out call closes and recreates the socket so a late reply can never be
taken as the answer to a later request.

Direct path (``local="auto"``, the default): after the first successful
call the client asks the master for its direct RPC sockets
(``Op.LOCAL_ENDPOINT``, :mod:`kvpool.master.local_rpc`): the Unix socket when
the master is on this host, else its TCP port; when that socket answers with
the same master instance, every later call goes over it (several times shorter
round trips than ZeroMQ, on one host and across hosts). If it breaks (master
restarted, link cut), calls go over ZeroMQ again and the socket is looked up
anew after a pause. Never used with CURVE (``local="off"`` forces ZeroMQ).
After sending over the direct socket the caller polls for the reply
without sleeping for up to ``spin_us`` (:class:`RpcPollConfig`; 0 = block at
once): the master usually answers within one handling time, and waking a
sleeping thread on a loaded host costs more than that. A small request that
is not a batch op (PUT_START, PUT_END, GET_REPLICA_LIST, ... of one key)
polls for up to ``spin_small_us`` instead (no poll at all when ``spin_us`` is
0): on a busy host its reply often comes later than the short window, and the
wake-up then added to each of a put's two master legs. A batch op keeps the
short window: its reply takes longer across hosts, and a longer poll would
only take more CPU per call from the master and the node.
The poll yields the CPU between tries (``sched_yield``: on a loaded host the
master or a node may be waiting for this very CPU; a yield that comes back
late, another task having run for a time slice, stops the polls of the
process for a while: :mod:`kvpool.core.spin`), and a stub polls only
while its replies of that kind (one-key / other) have of late come within
the window (a moving average of the reply waits, each capped at twice the
window so that one stall does not stop the polls, a wait slept through at
the window; a shut gate still polls once in 8 calls to learn whether polls
would pay again: :mod:`kvpool.core.spin`): when they come later the poll
would only burn CPU before the thread sleeps anyway. docs/BENCHMARKS.md has
what the polls measured.
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq

from kvpool.core import spin as _spin
from kvpool.core.codec import LOCAL_FRAME_HEADER as HEADER
from kvpool.core.codec import OPS, Op, Reply, ReplyFrame, Request, decode_reply, encode_request
from kvpool.core.config import check_settings, setting
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.etcd import EtcdError, LeaderResolver, is_etcd_url, shared_resolver
from kvpool.core.ops import LocalEndpoint, LocalEndpointReply

__all__ = ["MasterClient", "MasterRPCError", "RpcPollConfig"]

log = logging.getLogger(__name__)


def _address_is_ours(address: str) -> bool:
    """True if ``tcp://HOST:PORT``'s host is loopback or an address assigned in
    this network namespace (binding to it succeeds), or for ``ipc://``."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    hostport = address.split("://", 1)[-1]
    host = hostport.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _type, _proto, _canon, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


_PEEK_NOWAIT = socket.MSG_PEEK | socket.MSG_DONTWAIT
R = TypeVar("R", bound=Reply)
#: codes after which a call to a master group is sent again to the (new) leader
_FOLLOW = frozenset({ErrorCode.NOT_LEADER, ErrorCode.NO_LEADER, ErrorCode.RPC_FAIL,
                     ErrorCode.COORDINATION_UNAVAILABLE})
_LEADER_CHANGED = "the master group's leader changed while waiting for the reply"
#: a request at most this large that is not a batch op names one key
_SMALL_REQUEST = 256
#: ops whose master work grows with the keys they carry (the short spin)
_BATCH_OPS = frozenset(o for o in Op if o.name.startswith("BATCH_"))


@dataclass
class RpcPollConfig:
    """How long a master RPC stub polls its direct socket for a reply before it
    sleeps (see the module doc). A config that makes stubs nests it."""

    spin_us: int = setting(
        50, ge=0, help="microseconds a master call over the direct socket polls for its reply "
        "before sleeping (yielding the CPU between tries, and only while replies have of late "
        "come that soon); 0 = sleep at once, no poll for any call")
    spin_small_us: int = setting(
        150, ge=0, help="the same for a one-key request that is not a batch op (PUT_START, "
        "PUT_END, GET_REPLICA_LIST, ...), whose reply is near; the larger of the two applies")

    def validate(self) -> None:
        """Raise :class:`ConfigError` on a negative window."""
        check_settings(self)


_DEFAULT_POLL = RpcPollConfig()


class MasterRPCError(KVPoolError):
    """An op failed at the master (``code`` is the master's error code) or the
    master could not be reached (RPC_FAIL / RPC_TIMEOUT)."""


def normalize_address(address: str) -> str:
    """Accept ``host:port``, ``tcp://host:port`` or ``ipc://path``."""
    if "://" in address:
        return address
    return f"tcp://{address}"


def _unsent(exc: BaseException) -> bool:
    """Whether a local-socket failure happened before the request left (EPIPE /
    reset on send): safe to send it again over ZeroMQ."""
    cause = exc.__cause__
    return isinstance(cause, BrokenPipeError | ConnectionRefusedError) or (
        isinstance(cause, ConnectionResetError) and "closed the local" not in str(cause))


class MasterClient:
    """Synchronous RPC stub: ``call(request) -> typed reply``.

    ``request`` is one of the request Structs of :mod:`kvpool.core.protocol`;
    the reply is decoded into the op's reply Struct. Raises
    :class:`MasterRPCError` with the master's code for an error reply,
    ``RPC_TIMEOUT`` when no reply arrives within ``timeout_s``.

    A master group (HA, docs/ha.md) is addressed as
    ``etcd://HOST:PORT[;HOST:PORT...][/CLUSTER_ID]``: the stub sends to the
    leader etcd names and follows it. A call answered ``NOT_LEADER``, one
    whose leader went away before it answered (the wait is cut short when
    etcd names a new leader) or one sent while no leader serves is sent again
    to the current leader, for at most ``timeout_s + failover_timeout_s`` in
    all; then the last error is raised (``NO_LEADER`` when none appeared). A
    call that timed out, or was answered ``WRITE_OUTCOME_UNKNOWN`` (applied
    at a leader that could not replicate it), is resent only if etcd names a
    newer leader within that budget (a dead leader is silent until its lease
    lapses).
    ``poll``: the reply poll of the direct socket (:class:`RpcPollConfig`;
    None = its defaults); ``spin_s`` / ``spin_small_s`` hold it in seconds.
    A request resent after its leader died may have taken effect there
    (and, if replicated, at the new leader): a retried put can then answer
    as a conflict, never silently succeed twice.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
        local: str = "auto",
        failover_timeout_s: float = 6.0,
        poll: RpcPollConfig | None = None,
    ) -> None:
        if local not in ("auto", "off"):
            raise ValueError(f"local must be 'auto' or 'off', not {local!r}")
        #: the group's resolver when ``address`` is an ``etcd://`` URL
        self.resolver: LeaderResolver | None = None
        self.group = ""
        self.failover_timeout_s = failover_timeout_s
        self._epoch = 0  # the leader term calls go to (groups only)
        if is_etcd_url(address):
            self.resolver = shared_resolver(address)
            self.group = address
            leader = self.resolver.current()
            address = leader.address if leader is not None else "127.0.0.1:0"
            self._epoch = leader.epoch if leader is not None else 0
        self.address = normalize_address(address)
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._curve_server_key = curve_server_key
        self._curve_keypair = curve_keypair
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._closed = False
        # same-host Unix socket (see module docstring)
        self._local_on = local == "auto" and curve_server_key is None
        self._local_wanted = self._local_on
        self._usock: socket.socket | None = None
        self._utcp = False  # _usock is a TCP socket (its family read once: an enum per read)
        self._same_host: bool | None = None  # the master's address is one of ours
        self._zmq_ok = 0  # successful ZeroMQ calls since the last lookup
        self._next_lookup = 0.0
        self.local_calls = 0
        self._rbuf = bytearray(64 << 10)
        self._utimeout = -1.0  # the kernel send/recv timeout set on the Unix socket
        poll = poll or _DEFAULT_POLL
        #: seconds to poll the local socket for a reply before blocking (see _call_local)
        self.spin_s = poll.spin_us / 1e6
        #: the same for a small one-key request (see the module doc)
        self.spin_small_s = poll.spin_small_us / 1e6
        #: moving average of the reply wait, [batch-or-large, small one-key] (seconds)
        self._reply_wait = [0.0, 0.0]
        self._skipped = [0, 0]  # waits not polled since the last probe (core/spin.probe)

    @property
    def epoch(self) -> int:
        """The leader term (election epoch) this stub's calls go to: that of
        the leader which answered the last call; 0 for a single master."""
        return self._epoch

    @property
    def local(self) -> bool:
        """Whether calls currently go over a direct socket (Unix or TCP)."""
        return self._usock is not None

    def _local_socket(self) -> socket.socket | None:
        """The direct socket to the same master, looked up once the master
        has answered over ZeroMQ (so a one-shot client never pays for it)."""
        if self._usock is not None or not self._local_on:
            return self._usock
        if self._zmq_ok == 0 or time.monotonic() < self._next_lookup:
            return None
        self._next_lookup = time.monotonic() + 5.0  # at most one lookup per 5 s
        if self._same_host is None:
            # a socket path can be reachable from another network namespace
            # (same filesystem, other "host": containers, the chaos suite's
            # netns hosts); only a master whose TCP address is an address of
            # our own namespace is the same host
            self._same_host = _address_is_ours(self.address)
        try:
            rid = next(self._ids)
            frame = self._call_zmq(Op.LOCAL_ENDPOINT, rid, encode_request(rid, LocalEndpoint()),
                                   min(self.timeout_s, 1.0))
            if frame.code != ErrorCode.OK:
                return None
            res = self._result(Op.LOCAL_ENDPOINT, frame)
            assert isinstance(res, LocalEndpointReply)
            instance = res.instance
            if self._same_host and res.path:
                target: Any = res.path
                us = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            elif res.tcp_port and self.address.startswith("tcp://"):
                host = self.address[6:].rsplit(":", 1)[0].strip("[]")
                target = (host, res.tcp_port)
                us = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                   socket.SOCK_STREAM)
                us.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                self._local_on = self._same_host or False  # nothing to try again
                return None
            if not instance:
                us.close()
                return None
            try:
                us.settimeout(1.0)
                # fails where the path is on another host, or a firewall
                # keeps the port closed (then: again after the next pause)
                us.connect(target)
                us.settimeout(None)  # blocking; _call_local sets kernel timeouts
                self._utimeout = -1.0
                self._usock = us
                self._utcp = us.family != socket.AF_UNIX
                rid = next(self._ids)
                check = self._call_local(Op.LOCAL_ENDPOINT, rid,
                                         encode_request(rid, LocalEndpoint()), 1.0)
            except BaseException:
                self._drop_local()
                us.close()
                raise
            again = self._result(Op.LOCAL_ENDPOINT, check)
            if not isinstance(again, LocalEndpointReply) or again.instance != instance:
                self._drop_local()  # another master's socket at that path
                return None
            log.debug("master %s: using direct socket %s", self.address, target)
            return us
        except (OSError, KVPoolError) as exc:
            log.debug("master %s: no local socket (%s)", self.address, exc)
            return None

    def _drop_local(self) -> None:
        if self._usock is not None:
            self._usock.close()
            self._usock = None
            self._zmq_ok = 0

    def _call_local(self, op: Op, req_id: int, payload: bytes, timeout: float) -> ReplyFrame:
        """One request/reply over the Unix socket; returns the reply envelope.
        Raises RPC_TIMEOUT / RPC_FAIL (the socket is then dropped, so a late
        reply is never read as another call's)."""
        us = self._usock
        assert us is not None
        deadline = time.monotonic() + timeout
        rbuf = self._rbuf
        try:
            if timeout != self._utimeout:
                # kernel timeouts on a blocking socket: no poll() syscall per
                # send/recv as Python's own socket timeouts would add
                tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
                us.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                us.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
                self._utimeout = timeout
            # a peer that closed since the last call (master restarted): over TCP
            # the send below would still succeed and only the read would tell,
            # too late to know whether the request ran; a peek tells it now. A
            # Unix socket's send fails at once (EPIPE) then: no peek needed
            if self._utcp:
                try:
                    stale = us.recv(1, _PEEK_NOWAIT)
                except BlockingIOError:
                    stale = None  # alive, nothing pending: the normal case
                except ConnectionResetError as exc:
                    raise BrokenPipeError("the master closed the direct socket") from exc
                if stale is not None:
                    raise BrokenPipeError("the master closed the direct socket")
            us.sendall(len(payload).to_bytes(HEADER, "little") + payload)
            # most replies fit the reusable buffer in one recv_into (no allocation).
            # Poll without sleeping for a few µs first: the master usually answers
            # within one handling time, and a sleeping thread's wake-up costs more
            # (longer for a one-key op, whose reply is near; see the module doc)
            got = -1
            spin = self.spin_s
            small = len(payload) <= _SMALL_REQUEST and op not in _BATCH_OPS
            if spin and small:
                spin = max(spin, self.spin_small_s)
            polled = False
            if spin:
                sent = time.perf_counter()
                waits = self._reply_wait
                # replies come within the window of late (or a probe of a shut
                # gate), and this CPU is not busy: see core/spin.py
                if _spin.polling() and (waits[small] < spin
                                        or _spin.probe(self._skipped, small)):
                    polled = True
                    got = _spin.recv_polling(us, rbuf, sent + spin)
            if got < 0:
                if self.resolver is not None:
                    self._await_local_reply(us, op, deadline)
                got = us.recv_into(rbuf)
            if spin:  # how long replies take, of late: a moving average of waits
                wait = _spin.wait_sample(time.perf_counter() - sent, polled, spin)
                waits[small] += (wait - waits[small]) * 0.125
            buf: bytearray | memoryview = memoryview(rbuf)[:got]
            need = HEADER + int.from_bytes(rbuf[:HEADER], "little") if got >= HEADER else HEADER
            if got < need:
                buf = bytearray(buf)
            while len(buf) < need:
                if not got:
                    raise ConnectionResetError("master closed the local socket")
                if deadline - time.monotonic() <= 0:
                    raise TimeoutError
                chunk = us.recv(max(65536, need - len(buf)))
                got = len(chunk)
                assert isinstance(buf, bytearray)
                buf += chunk
                if need == HEADER and len(buf) >= HEADER:
                    need = HEADER + int.from_bytes(buf[:HEADER], "little")
        except (TimeoutError, BlockingIOError) as exc:  # EAGAIN: SO_RCVTIMEO/SO_SNDTIMEO
            self._drop_local()
            raise MasterRPCError(
                f"{op.name}: no reply from master {self.address} within {timeout:.1f}s",
                ErrorCode.RPC_TIMEOUT) from exc
        except OSError as exc:
            self._drop_local()
            raise MasterRPCError(f"{op.name}: local socket to master {self.address}: {exc}",
                                 ErrorCode.RPC_FAIL) from exc
        try:
            reply = decode_reply(memoryview(buf)[HEADER:need] if isinstance(buf, bytearray)
                                 else buf[HEADER:need])
        except KVPoolError:
            reply = None
        if reply is None or reply.id != req_id:
            self._drop_local()
            if reply is not None and reply.id is None \
                    and reply.code == ErrorCode.FRAME_TOO_LARGE:
                # the master refused a frame it would not buffer (and closed the socket)
                raise MasterRPCError(f"{op.name}: {reply.error}", ErrorCode.FRAME_TOO_LARGE)
            raise MasterRPCError(f"{op.name}: unexpected reply on the local socket",
                                 ErrorCode.RPC_FAIL)
        self.local_calls += 1
        return reply

    def _await_local_reply(self, us: socket.socket, op: Op, deadline: float) -> None:
        """A group's call on the direct socket: wait for the reply in slices, cut
        short when etcd names another leader (as the ZeroMQ path does), so a call
        to a leader that was partitioned away does not wait its whole timeout.
        Raises TimeoutError at the deadline."""
        poller = select.poll()
        poller.register(us, select.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if poller.poll(int(min(remaining, 0.05) * 1000) + 1):
                return
            if self._leader_moved():
                self._drop_local()
                raise MasterRPCError(f"{op.name}: {_LEADER_CHANGED}", ErrorCode.RPC_FAIL)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve_server_key is not None:
                if self._curve_keypair is None:
                    pub, sec = zmq.curve_keypair()
                else:
                    pub, sec = self._curve_keypair
                sock.curve_serverkey = self._curve_server_key
                sock.curve_publickey = pub
                sock.curve_secretkey = sec
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def call(self, request: Request[R], timeout_s: float | None = None) -> R:
        """Send one request and wait for its reply; return the typed reply."""
        op = request.OP
        rid = next(self._ids)
        frame = self._roundtrip(op, rid, encode_request(rid, request), timeout_s)
        return self._result(op, frame)  # type: ignore[no-any-return]

    def call_raw(self, op: Op | int, args: Any, timeout_s: float | None = None) -> Any:
        """Send ``args`` (any msgpack-able value) as op's arguments: for tools and
        tests that probe the master with malformed requests. Returns the
        decoded reply Struct of a known op."""
        rid = next(self._ids)
        payload = msgspec.msgpack.encode([int(op), rid, args])
        try:
            known = Op(op)
        except ValueError:
            known = None
        frame = self._roundtrip(known or Op.PING, rid, payload, timeout_s)
        if known is None:
            self._check(Op.PING, frame)
            return None
        return self._result(known, frame)

    def _roundtrip(self, op: Op, rid: int, payload: bytes,
                   timeout_s: float | None) -> ReplyFrame:
        if self._closed:
            raise MasterRPCError("master client is closed", ErrorCode.CLOSED)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.resolver is None:
            return self._roundtrip_once(op, rid, payload, timeout)
        deadline = time.monotonic() + timeout + self.failover_timeout_s
        while True:
            try:
                self._follow_leader(deadline)
                frame = self._roundtrip_once(op, rid, payload,
                                             min(timeout, max(0.05, deadline - time.monotonic())))
                if frame.code == ErrorCode.WRITE_OUTCOME_UNKNOWN:
                    # applied at the leader, never acknowledged: as a timeout
                    raise MasterRPCError(f"{op.name}: {frame.error}", frame.code)
                if frame.code not in (ErrorCode.NOT_LEADER, ErrorCode.COORDINATION_UNAVAILABLE):
                    return frame
                err: KVPoolError = MasterRPCError(f"{op.name}: {frame.error}", frame.code)
            except KVPoolError as exc:
                if exc.code in (ErrorCode.RPC_TIMEOUT, ErrorCode.WRITE_OUTCOME_UNKNOWN):
                    # a leader that died (or hangs) goes silent until its lease
                    # lapses: resend only once etcd names a newer one
                    try:
                        self.resolver.wait(max(0.0, deadline - time.monotonic()),
                                           newer_than=self._epoch)
                    except KVPoolError:
                        raise exc from None
                    continue
                if exc.code not in _FOLLOW:
                    raise
                err = exc
            if time.monotonic() >= deadline:
                if isinstance(err, MasterRPCError):
                    raise err
                raise MasterRPCError(str(err), err.code)
            log.debug("%s: %s; following the leader of %s", op.name, err, self.group)
            try:
                self.resolver.refresh()
            except EtcdError:
                pass
            time.sleep(0.02)

    def _follow_leader(self, deadline: float) -> None:
        """Point the socket at the leader etcd names (wait for one until ``deadline``)."""
        assert self.resolver is not None
        leader = self.resolver.current()
        if leader is None:
            leader = self.resolver.wait(max(0.01, deadline - time.monotonic()))
        addr = normalize_address(leader.address)
        self._epoch = leader.epoch
        if addr != self.address:
            with self._lock:
                self._reset()
                self._drop_local()
                self.address = addr
                self._local_on = self._local_wanted
                self._next_lookup = 0.0
            log.info("master group %s: calls go to %s (epoch %d)", self.group, addr,
                     leader.epoch)

    def _leader_moved(self) -> bool:
        r = self.resolver
        if r is None:
            return False
        leader = r.current()
        return leader is None or leader.epoch != self._epoch

    def _roundtrip_once(self, op: Op, rid: int, payload: bytes,
                        timeout: float) -> ReplyFrame:
        with self._lock:
            reply: ReplyFrame | None = None
            if self._local_on and self._local_socket() is not None:
                try:
                    reply = self._call_local(op, rid, payload, timeout)
                except MasterRPCError as exc:
                    if exc.code != ErrorCode.RPC_FAIL or not _unsent(exc):
                        raise
                    reply = None  # the master went away before it got the request
            if reply is None:
                reply = self._call_zmq(op, rid, payload, timeout)
                self._zmq_ok += 1
        return reply

    @staticmethod
    def _check(op: Op, frame: ReplyFrame) -> None:
        if frame.code != ErrorCode.OK:
            raise MasterRPCError(f"{op.name}: {frame.error}", frame.code)

    @staticmethod
    def _result(op: Op, frame: ReplyFrame) -> Any:
        """The op's reply Struct, or MasterRPCError for an error reply."""
        if frame.code != ErrorCode.OK:
            raise MasterRPCError(f"{op.name}: {frame.error}", frame.code)
        try:
            return OPS[op].reply_decoder.decode(frame.result)
        except msgspec.MsgspecError as exc:
            raise MasterRPCError(f"{op.name}: malformed reply: {exc}",
                                 ErrorCode.MALFORMED_FRAME) from None

    def _call_zmq(self, op: Op, req_id: int, payload: bytes, timeout: float) -> ReplyFrame:
        """One request/reply over the DEALER socket (lock held); the reply envelope."""
        sock = self._socket()
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again as exc:
            self._reset()
            raise MasterRPCError(
                f"cannot send to master {self.address}", ErrorCode.RPC_FAIL
            ) from exc
        deadline = time.monotonic() + timeout
        group = self.resolver is not None
        while True:
            remaining = deadline - time.monotonic()
            # a group member: wait in slices, cut short when etcd names another leader
            wait_ms = int(min(remaining, 0.05) * 1000) + 1 if group else \
                int(remaining * 1000) + 1
            if remaining <= 0:
                self._reset()
                raise MasterRPCError(
                    f"{op.name}: no reply from master {self.address} within {timeout:.1f}s",
                    ErrorCode.RPC_TIMEOUT,
                )
            if not sock.poll(wait_ms, zmq.POLLIN):
                if group and self._leader_moved():
                    self._reset()
                    raise MasterRPCError(f"{op.name}: {_LEADER_CHANGED}", ErrorCode.RPC_FAIL)
                continue
            frames = sock.recv_multipart()
            try:
                reply = decode_reply(frames[-1])
            except KVPoolError:
                continue
            if reply.id != req_id:
                continue  # a stale reply to an earlier, timed-out request
            return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()
            self._drop_local()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
