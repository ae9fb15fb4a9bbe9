"""Journal replication from the leader to hot standbys.

Every record the leader's directory emits gets a **log position** (``lsn``:
one per record, continuing across terms). The leader publishes each group
commit as one batch to every connected standby: a small header ``[BATCH,
epoch, first_lsn, count, records' epoch, [stream record, ...], urgent]``
and, as a second part, the directory records exactly as the leader's journal
wrote them (its batch frames, :func:`~kvpool.master.journal.encode_frames`:
encoded once per group commit, never per standby). A standby checks the
frames (lengths, checksums, record count; nothing decoded), writes them to
its data dir as they are with its position (see :class:`ReplicaSink`),
answers ``[ACK, epoch, last_lsn]`` (cumulative: one ack for every batch that
arrived together; at once when ``urgent``, i.e. it is in the in-sync set,
else within ``_LAZY_ACK_S``) and only then decodes and applies them to its
own directory. Batches for a standby outside the in-sync set may be held
back briefly and sent merged (``ReplicationSource.lazy_send_s``), so it
takes several per wake-up. The leader never waits for an ack before sending the next batch
(any number are in flight); it releases the replies of a batch once every
member of its **in-sync set** acknowledged it
(:meth:`ReplicationSource.acked_lsn`); the set is published in etcd
(:mod:`.election`), so whoever wins the next election holds every
acknowledged change.

A standby says hello with the epoch and lsn of the last record it applied.
The leader keeps the epoch history (``[(epoch, first_lsn)]``) and a ring of
recent batches: if the standby's last record lies on the leader's history
and the ring still holds what follows, it gets that tail; otherwise (it
restarted, it was a leader whose unacknowledged tail was never replicated,
it is too far behind) it gets a **snapshot** streamed in slices by the
leader's loop, interleaved in order with the live batches. Applying
everything in wire order is exact: a slice carries the objects' state at
the moment it is sent, which includes every batch sent before it.

Standbys refuse batches of an epoch older than the newest they know (from
etcd or an earlier batch), so a deposed leader cannot collect acks.

Transport (:mod:`.transport`): the leader's bind address says which. A
``socket://HOST:PORT`` stream is a plain TCP connection per standby, served
on the leader's loop and read on the standby's (two thread wake-ups per
round trip); any other address is ZeroMQ, ROUTER -> DEALER, used where CURVE
applies (``curve``: the master's :class:`~kvpool.core.auth.CurveConfig`, the
same policy and keys as its client socket): the leader's ROUTER is then a
CURVE server whose ZAP allow-list admits only the configured client keys,
and a standby's DEALER authenticates with its own keypair, so a standby
without the group's keys cannot join (nor read the stream). A standby whose
CURVE policy applies to the leader's host refuses a ``socket://`` stream.

Wire: msgpack arrays, one part per message (``MsgType`` first), except a
batch's second part (its journal frames); the transport delimits them.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, NamedTuple, Protocol

import msgspec
import zmq

from kvpool.core.auth import CurveConfig
from kvpool.core.errors import ErrorCode
from kvpool.master.directory import Directory, SegState
from kvpool.master.durability import StreamPosition
from kvpool.master.ha.transport import (
    SOCKET_SCHEME,
    LeaderTransport,
    SocketLeader,
    SocketStandby,
    StandbyTransport,
    ZmqLeader,
    ZmqStandby,
    host_of,
)
from kvpool.master.journal import check_frames, encode_frames, iter_frame_payloads
from kvpool.master.records import decode_frame

__all__ = [
    "REPLICATION_PROTOCOL",
    "Batch",
    "MsgType",
    "ReplicaSink",
    "ReplicationLog",
    "ReplicationSource",
    "SinkState",
    "StandbyStatus",
    "promote_directory",
]

log = logging.getLogger(__name__)


class MsgType(IntEnum):
    # standby -> leader: [1, instance_id, known_epoch, last_epoch, last_lsn, protocol]
    HELLO = 1
    # leader -> standby: [2, epoch, first_lsn, count, records' epoch, [stream record, ...],
    # urgent] + a second frame: the directory records (count - stream records) as
    # journal frames; urgent: replies wait for this standby's ack (ack at once)
    BATCH = 2
    ACK = 3  # standby -> leader: [3, epoch, last_lsn]
    SNAP_BEGIN = 4  # leader -> standby: [4, epoch, lsn, [segment wire, ...], history]
    SNAP_CHUNK = 5  # leader -> standby: [5, epoch, [snapshot record, ...]]
    SNAP_END = 6  # leader -> standby: [6, epoch, lsn, objects]
    HEARTBEAT = 7  # leader -> standby: [7, epoch, last_lsn] (idle stream)
    REFUSE = 8  # either way: [8, code, message, epoch]
    TAIL = 9  # leader -> standby: [9, epoch, from_lsn, history] (no snapshot needed)


#: the stream's format, in every HELLO: a leader refuses a standby of another
#: (1: batches of decoded records, before the journal frames were shipped as written)
REPLICATION_PROTOCOL = 2

# msgspec writes the same bytes as msgpack.packb(use_bin_type=True), ~4x faster
# (a batch of 128 PUT records: ~4 us instead of ~18 us per group commit), and
# reads them ~2x faster than msgpack.unpackb
_pack = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
_BATCH = int(MsgType.BATCH)
_ACK = int(MsgType.ACK)
#: messages a standby takes in one go (one write and one ack for the batches
#: among them) before it writes, acks and applies what it has
_SINK_DRAIN = 256
#: records a standby applies between two looks for new batches (which it then
#: writes and acks before it applies on): a batch's ack never waits for the
#: whole apply of the one before
_APPLY_SLICE = 128
#: a standby whose acks hold no reply (not in the in-sync set) acks at most
#: this often: the leader wakes for the acks that release replies
_LAZY_ACK_S = 0.01
#: a standby being sent a snapshot gets its next slice only once the kernel
#: took all but this much of what it was sent (the socket transport's buffer)
_SNAPSHOT_BACKLOG = 8 << 20


def _unpack(data: bytes) -> list[Any] | None:
    try:
        msg = _decode(data)
    except Exception:
        return None
    if type(msg) is not list or not msg or type(msg[0]) is not int:
        return None
    return msg


def decode_frames(frames: bytes) -> list[Any]:
    """The records of journal frames (``encode_frames``'s inverse)."""
    out: list[Any] = []
    for payload in iter_frame_payloads(frames):
        out += _decode(payload)
    return out


class Batch(NamedTuple):
    """One group commit in the log: ``length`` records from lsn ``first`` of
    term ``epoch``: the directory records, as journal ``frames``, then the
    stream-only ``extras``."""

    epoch: int
    first: int
    length: int
    frames: bytes
    extras: list[Any]

    @property
    def last(self) -> int:
        return self.first + self.length - 1

    def after(self, lsn: int) -> Batch:
        """The part of this batch after ``lsn`` (inside it)."""
        skip = lsn + 1 - self.first
        n_dir = self.length - len(self.extras)
        if skip < n_dir:  # re-encoded: a tail that starts inside a batch is rare
            return Batch(self.epoch, lsn + 1, self.length - skip,
                         encode_frames(decode_frames(self.frames)[skip:]), self.extras)
        return Batch(self.epoch, lsn + 1, self.length - skip, b"", self.extras[skip - n_dir:])

    def header(self, leader_epoch: int, urgent: bool = True) -> bytes:
        return _pack([_BATCH, leader_epoch, self.first, self.length, self.epoch, self.extras,
                      urgent])


# ================================================================ the log
class ReplicationLog:
    """Positions, epoch history and a ring of recent batches (the tail a
    returning standby can be given without a snapshot). Shared by a
    standby's sink and, after promotion, its source."""

    def __init__(self, ring_records: int = 1 << 20) -> None:
        self.last_lsn = 0
        self.last_epoch = 0
        self.history: list[tuple[int, int]] = []  # (epoch, first lsn of that epoch)
        # batches as encoded bytes: compact, and nothing for the collector to scan
        self.ring: collections.deque[Batch] = collections.deque()
        self._ring_records = 0
        self.ring_limit = ring_records

    def append(self, batch: Batch) -> None:
        epoch = batch.epoch
        if not self.history or self.history[-1][0] != epoch:
            self.history.append((epoch, batch.first))
        self.last_epoch = epoch
        self.last_lsn = batch.first + batch.length - 1
        ring = self.ring
        ring.append(batch)
        self._ring_records += batch.length
        while self._ring_records > self.ring_limit and len(ring) > 1:
            self._ring_records -= ring.popleft().length

    def start_epoch(self, epoch: int) -> None:
        """A new term begins at the next position (the leader's history)."""
        if not self.history or self.history[-1][0] != epoch:
            self.history.append((epoch, self.last_lsn + 1))
        self.last_epoch = epoch

    def adopt_history(self, history: list[Any]) -> None:
        """Take the leader's history up to our own position (a tail follows)."""
        self.history = [(int(e), int(f)) for e, f in history if int(f) <= self.last_lsn]

    def reset(self, epoch: int, lsn: int, history: list[tuple[int, int]]) -> None:
        """After a snapshot: positions as the leader's, the ring empty."""
        self.last_lsn = lsn
        self.last_epoch = epoch
        self.history = [(int(e), int(f)) for e, f in history]
        self.ring.clear()
        self._ring_records = 0

    def end_of(self, epoch: int) -> int | None:
        """The last lsn of ``epoch`` on this history (None: not on it)."""
        for i, (e, _first) in enumerate(self.history):
            if e == epoch:
                if i + 1 < len(self.history):
                    return self.history[i + 1][1] - 1
                return self.last_lsn
        return None

    def tail_from(self, lsn: int) -> Iterator[Batch] | None:
        """Batches covering every position after ``lsn`` (None: not held anymore)."""
        if lsn >= self.last_lsn:
            return iter(())
        if not self.ring or self.ring[0].first > lsn + 1:
            return None

        def gen() -> Iterator[Batch]:
            for b in list(self.ring):
                if b.last <= lsn:
                    continue
                yield b.after(lsn) if b.first <= lsn else b
        return gen()


# ================================================================ leader side
class StandbyState(StrEnum):
    SNAPSHOT = "snapshot"
    STREAMING = "streaming"


@dataclass
class StandbyStatus:
    """What the leader knows of one standby (for health, status and metrics)."""

    instance_id: str
    state: StandbyState
    acked_lsn: int = 0
    in_sync: bool = False
    last_ack: float = 0.0  # monotonic
    connected_at: float = 0.0

    def lag(self, leader_lsn: int) -> int:
        return max(0, leader_lsn - self.acked_lsn)


@dataclass
class _Standby:
    ident: Any  # the transport's peer handle (ZeroMQ: the routing id)
    status: StandbyStatus
    snap_count: int = 0
    chunks: Iterator[list[str]] | None = None  # set while a snapshot is being sent
    # when it last went from holding everything to owing a batch: an idle
    # standby's last ack is old, but it owes the next batch only from its send
    owed_since: float = 0.0
    # batches held back for a standby outside the in-sync set (``lazy_send_s``):
    # sent together, before anything else sent to it
    queued: list[Batch] = field(default_factory=list)


class ReplicationSource:
    """The leader's end: the socket standbys connect to (``bind``:
    ``socket://HOST:PORT`` for the plain transport, served from ``listener``
    when given; else a ZeroMQ ROUTER).

    Driven by the master's loop: ``publish(records)`` after each group commit
    (returns the batch's last lsn), ``poll()`` between iterations (hellos,
    acks, snapshot slices of ``snapshot_slice_s``), ``acked_lsn()`` to know
    which replies may go. The in-sync set is changed only by the caller
    (after it published the change in etcd): ``add_sync`` / ``remove_sync``.

    ``lazy_send_s`` > 0: batches for a standby outside the in-sync set (no
    reply waits for its ack) are held back and sent together, the first of
    them at most that long after its publish (by :meth:`poll`, also by
    :meth:`flush_lazy`, and before anything else sent to that standby, so
    the wire order is kept): it then takes, writes and acks several batches
    per wake-up instead of one, and the leader's I/O thread wakes once for
    them. Such a standby lags by up to that much more (it is not elected
    unless it joins the in-sync set; with ``sync_standbys: 0`` this adds to
    what a failover may lose). Batches for in-sync members leave at once.
    """

    def __init__(self, directory: Directory, bind: str, epoch: int,
                 log_: ReplicationLog | None = None, context: zmq.Context | None = None,
                 snapshot_slice_s: float = 0.004, heartbeat_s: float = 0.1,
                 curve: CurveConfig | None = None, lazy_send_s: float = 0.0,
                 listener: socket.socket | None = None) -> None:
        self.dir = directory
        self.epoch = epoch
        self.log = log_ or ReplicationLog()
        self.log.start_epoch(epoch)
        self.snapshot_slice_s = snapshot_slice_s
        self.heartbeat_s = heartbeat_s
        # ``socket://``: served on the caller's loop; else ZeroMQ (CURVE where active)
        self.transport: LeaderTransport
        if bind.startswith(SOCKET_SCHEME):
            self.transport = SocketLeader(bind, listener)
        else:
            self.transport = ZmqLeader(context or zmq.Context.instance(), bind, curve)
        self.endpoint = self.transport.endpoint
        self.standbys: dict[str, _Standby] = {}
        self.sync_members: set[str] = set()
        self.lazy_send_s = lazy_send_s
        #: when the oldest held-back batch is due (0.0: none held back)
        self.lazy_due = 0.0
        self._snapshots = 0  # standbys being sent a snapshot (see _count_snapshots)
        #: changes of :attr:`standbys` (a hello, a standby forgotten): the
        #: caller looks for joiners only when this moved
        self.sessions = 0
        self._last_send = time.monotonic()
        self.batches_sent = 0
        self.snapshots_sent = 0

    # ---------------------------------------------------------------- publish
    @property
    def last_lsn(self) -> int:
        return self.log.last_lsn

    def publish(self, records: list[Any], extras: list[Any] | None = None,
                frames: bytes | None = None) -> int:
        """Give the committed directory ``records`` and then the stream-only
        ``extras`` positions and send them; return the last lsn. ``frames``:
        the records as the journal wrote them (``encode_frames(records)``),
        sent as they are; encoded here when not given."""
        count = len(records) + (len(extras) if extras else 0)
        if not count:
            return self.log.last_lsn
        if frames is None:
            frames = encode_frames(records)
        b = Batch(self.epoch, self.log.last_lsn + 1, count, frames, extras or [])
        self.log.append(b)
        if self.standbys:
            # in-sync members ack at once (replies wait for them), others lazily
            urgent = lazy = b""
            sync = self.sync_members
            now = time.monotonic()
            send = self.transport.send
            hold = self.lazy_send_s > 0
            for sid, sb in self.standbys.items():
                if sb.status.acked_lsn >= b.first - 1:
                    sb.owed_since = now
                if sid in sync:
                    header = urgent = urgent or b.header(self.epoch, True)
                else:
                    header = lazy = lazy or b.header(self.epoch, False)
                    if hold:
                        if not self.lazy_due:
                            self.lazy_due = now + self.lazy_send_s
                        sb.queued.append(b)
                        continue
                if sb.queued:
                    self._flush_queued(sb)
                send(sb.ident, header, frames)
            self._last_send = now
            self.batches_sent += 1
        return self.log.last_lsn

    def flush_lazy(self) -> None:
        """Send every held-back batch now (``lazy_send_s``)."""
        self.lazy_due = 0.0
        merged: dict[tuple[int, int], list[tuple[bytes, bytes]]] = {}
        for sb in self.standbys.values():
            if sb.queued:
                self._flush_queued(sb, merged)

    def _flush_queued(self, sb: _Standby,
                      merged: dict[tuple[int, int], list[tuple[bytes, bytes]]] | None = None
                      ) -> None:
        """Send ``sb``'s held-back batches as few messages (``_merge``; built
        once per flush for standbys that wait for the same batches)."""
        q = sb.queued
        key = (q[0].first, q[-1].last)
        msgs = merged.get(key) if merged is not None else None
        if msgs is None:
            msgs = self._merge(q)
            if merged is not None:
                merged[key] = msgs
        send = self.transport.send
        ident = sb.ident
        for header, frames in msgs:
            send(ident, header, frames)
        q.clear()

    def _merge(self, batches: list[Batch]) -> list[tuple[bytes, bytes]]:
        """Consecutive batches as (header, frames) messages, each covering as
        many as can be one batch: of one records' epoch, stream-only records
        only in the last (a batch's are positioned after its directory
        records), their journal frames concatenated (a standby writes them as
        they are)."""
        out: list[tuple[bytes, bytes]] = []
        group: list[Batch] = []

        def close() -> None:
            if len(group) == 1:
                out.append((group[0].header(self.epoch, False), group[0].frames))
            else:
                last = group[-1]
                first = group[0].first
                out.append((_pack([_BATCH, self.epoch, first, last.last - first + 1,
                                   last.epoch, last.extras, False]),
                            b"".join(g.frames for g in group)))
            group.clear()

        for b in batches:
            if group and b.epoch != group[-1].epoch:
                close()
            group.append(b)
            if b.extras:
                close()
        if group:
            close()
        return out

    def _send(self, ident: Any, header: bytes, body: bytes = b"") -> None:
        if self.lazy_due:  # what was held back for it goes first (wire order)
            sb = self._by_ident(ident)
            if sb is not None and sb.queued:
                self._flush_queued(sb)
        self.transport.send(ident, header, body)
        self._last_send = time.monotonic()

    # ---------------------------------------------------------------- acks
    def acked_lsn(self) -> int:
        """Every position up to this is held by all in-sync members (with none,
        by the leader alone: the caller decides whether that suffices)."""
        lsn = self.log.last_lsn
        for m in self.sync_members:
            sb = self.standbys.get(m)
            if sb is None:
                return min(lsn, 0)
            lsn = min(lsn, sb.status.acked_lsn)
        return lsn

    def caught_up(self) -> list[str]:
        """Standbys outside the in-sync set that hold everything: candidates to add."""
        last = self.log.last_lsn
        return [i for i, sb in self.standbys.items()
                if i not in self.sync_members and sb.status.state is StandbyState.STREAMING
                and sb.status.acked_lsn >= last]

    def lagging(self, timeout_s: float) -> list[str]:
        """In-sync members that owe an ack for longer than ``timeout_s``
        (or are gone): candidates to remove (after etcd says so). Owing
        starts at the later of its last ack and the send of the first batch
        it has not acked."""
        now = time.monotonic()
        last = self.log.last_lsn
        out = []
        for m in self.sync_members:
            sb = self.standbys.get(m)
            if sb is None or (sb.status.acked_lsn < last
                              and now - max(sb.status.last_ack, sb.owed_since) > timeout_s):
                out.append(m)
        return out

    def add_sync(self, instance_id: str) -> None:
        self.sync_members.add(instance_id)
        sb = self.standbys.get(instance_id)
        if sb is not None:
            sb.status.in_sync = True
            if sb.queued:  # its acks count from now: nothing may wait behind the timer
                self._flush_queued(sb)

    def remove_sync(self, instance_id: str) -> None:
        self.sync_members.discard(instance_id)
        sb = self.standbys.get(instance_id)
        if sb is not None:
            sb.status.in_sync = False

    def status(self) -> list[StandbyStatus]:
        return [sb.status for sb in self.standbys.values()]

    # ---------------------------------------------------------------- poll
    def poll(self, readable: bool = True) -> int:
        """Handle what arrived (non-blocking; not looked for when ``readable``
        is False: the caller's poll saw nothing) and advance snapshots; return
        messages handled."""
        n = 0
        if readable:
            handle = self._handle
            for ident, data in self.transport.recv_all():
                n += 1
                msg = _unpack(data)
                if msg is not None:
                    handle(ident, msg)
        if self._snapshots:
            backlog = self.transport.backlog
            for sb in list(self.standbys.values()):
                # a standby that does not keep up gets no more slices until it does
                if sb.chunks is not None and backlog(sb.ident) < _SNAPSHOT_BACKLOG:
                    self._snapshot_step(sb)
        now = time.monotonic()
        if self.lazy_due and now >= self.lazy_due:
            self.flush_lazy()
        if now - self._last_send > self.heartbeat_s and self.standbys:
            frame = _pack([MsgType.HEARTBEAT, self.epoch, self.log.last_lsn])
            for sb in self.standbys.values():
                self._send(sb.ident, frame)
        return n

    def _refuse(self, ident: Any, code: ErrorCode, message: str) -> None:
        self._send(ident, _pack([MsgType.REFUSE, int(code), message, self.epoch]))

    def _handle(self, ident: Any, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == _ACK and len(msg) == 3:  # the common message first
            _t, epoch, lsn = msg
            sb = self._by_ident(ident)
            if sb is None or epoch != self.epoch or type(lsn) is not int:
                return
            if sb.chunks is None and lsn > sb.status.acked_lsn:
                sb.status.acked_lsn = min(lsn, self.log.last_lsn)
                sb.status.last_ack = time.monotonic()
        elif kind == MsgType.HELLO and len(msg) in (5, 6):
            _t, instance_id, known_epoch, last_epoch, last_lsn = msg[:5]
            if type(instance_id) is not str or not all(
                    type(v) is int for v in (known_epoch, last_epoch, last_lsn)):
                return
            protocol = msg[5] if len(msg) == 6 else 1
            if protocol != REPLICATION_PROTOCOL:
                log.warning("standby %s speaks replication protocol %r, this leader %d: "
                            "refused (run one kvpool version in a group)", instance_id,
                            protocol, REPLICATION_PROTOCOL)
                self._refuse(ident, ErrorCode.INVALID_VERSION,
                             f"replication protocol {protocol!r}, the leader speaks "
                             f"{REPLICATION_PROTOCOL}")
                return
            if known_epoch > self.epoch:
                # the standby has seen a newer term: we are deposed
                self._refuse(ident, ErrorCode.STALE_EPOCH,
                             f"epoch {self.epoch} is older than {known_epoch}")
                return
            self._hello(ident, instance_id, last_epoch, last_lsn)
        elif kind == MsgType.REFUSE and len(msg) == 4:
            sb = self._by_ident(ident)
            log.warning("standby %s refused the stream: %s",
                        sb.status.instance_id if sb else ident, msg[2])
            if sb is not None:
                self._forget(sb.status.instance_id)

    def _by_ident(self, ident: Any) -> _Standby | None:
        for sb in self.standbys.values():
            if sb.ident == ident:
                return sb
        return None

    def _forget(self, instance_id: str) -> None:
        sb = self.standbys.pop(instance_id, None)
        if sb is not None:
            self.transport.drop(sb.ident)
        self._count_snapshots()

    def _count_snapshots(self) -> None:
        self.sessions += 1
        self._snapshots = sum(1 for sb in self.standbys.values() if sb.chunks is not None)

    def _hello(self, ident: Any, instance_id: str, last_epoch: int, last_lsn: int) -> None:
        now = time.monotonic()
        old = self.standbys.get(instance_id)
        if old is not None and old.ident != ident:
            self.transport.drop(old.ident)  # it dialed again: the old connection is dead
        status = StandbyStatus(instance_id, StandbyState.STREAMING, last_lsn,
                               instance_id in self.sync_members, now, now)
        # an empty standby is on every history (position 0)
        end = self.log.end_of(last_epoch) if last_epoch else (0 if last_lsn == 0 else None)
        tail = self.log.tail_from(last_lsn) if end is not None and last_lsn <= end else None
        if tail is not None:
            sb = _Standby(ident, status)
            self.standbys[instance_id] = sb
            self._count_snapshots()
            self._send(ident, _pack([MsgType.TAIL, self.epoch, last_lsn + 1, self.log.history]))
            for b in tail:
                self._send(ident, b.header(self.epoch), b.frames)
            log.info("standby %s: streaming from lsn %d", instance_id, last_lsn + 1)
            return
        # a snapshot, interleaved in order with the live batches
        status.state = StandbyState.SNAPSHOT
        status.acked_lsn = 0
        d = self.dir
        sb = _Standby(ident, status, chunks=d.objects.key_chunks())
        self.standbys[instance_id] = sb
        self._count_snapshots()
        self._send(ident, _pack([MsgType.SNAP_BEGIN, self.epoch, self.log.last_lsn,
                                 d.segtab.wires(), self.log.history]))
        self.snapshots_sent += 1
        log.info("standby %s (last %d/%d): sending a snapshot at lsn %d", instance_id,
                 last_epoch, last_lsn, self.log.last_lsn)

    def _snapshot_step(self, sb: _Standby) -> None:
        deadline = time.perf_counter() + self.snapshot_slice_s
        record_of = self.dir.replay.snapshot_record
        assert sb.chunks is not None
        while time.perf_counter() < deadline:
            keys = next(sb.chunks, None)
            if keys is None:
                self._send(sb.ident, _pack([MsgType.SNAP_END, self.epoch, self.log.last_lsn,
                                            sb.snap_count]))
                sb.chunks = None
                self._count_snapshots()
                sb.status.state = StandbyState.STREAMING
                sb.status.last_ack = time.monotonic()
                return
            recs = [r for r in map(record_of, keys) if r is not None]
            sb.snap_count += len(recs)
            if recs:
                self._send(sb.ident, _pack([MsgType.SNAP_CHUNK, self.epoch, recs]))

    @property
    def pollable(self) -> Any:
        """What the caller's poller (LoopPoller) watches: readable when :meth:`poll`
        has something to read (acks, hellos, a connection, room to send)."""
        return self.transport.pollable

    def wait(self, timeout_ms: int) -> bool:
        """Block up to ``timeout_ms`` for something for :meth:`poll`."""
        return self.transport.wait(timeout_ms)

    def close(self) -> None:
        self.transport.close()


# ================================================================ standby side
class SinkState(StrEnum):
    CONNECTING = "connecting"
    SNAPSHOT = "snapshot"
    STREAMING = "streaming"
    REFUSED = "refused"


@dataclass
class SinkStats:
    batches: int = 0
    records: int = 0
    snapshots: int = 0
    refused: int = 0
    last_message: float = field(default_factory=time.monotonic)


class ReplicaStore(Protocol):
    """Where a standby keeps the stream (``kvpool.master.durability.Durability``)."""

    def commit_stream(self, frames: list[bytes], records: int,
                      position: StreamPosition) -> None: ...

    def rebase(self, directory: Directory, position: StreamPosition) -> bool: ...

    def discard_snapshot(self) -> None: ...


class ReplicaSink:
    """A standby's end: follows one leader, applies what it sends.

    ``connect(endpoint, epoch)`` (re)targets the leader of ``epoch``;
    ``poll(timeout_s)`` applies what arrived. Every batch that arrived
    together (up to ``_SINK_DRAIN`` messages) is checked, then, with a
    ``store``, written to the data dir in one write (the leader's journal
    frames as they are, and the position after them), then acknowledged with
    one ACK, then decoded and applied to the directory (``journaling`` off:
    they are the leader's records) ``_APPLY_SLICE`` records at a time
    (:meth:`Directory.apply_records`); batches arriving meanwhile are
    written and acked between two slices, so an ack never waits for the
    apply of earlier batches. Messages other than batches are handled once
    every batch before them is applied; when :meth:`poll` returns,
    everything received is applied. ``based``: the store holds exactly
    this directory's state (restored from it, or written by ``rebase``);
    until then nothing is journaled, and a directory received whole (a
    snapshot, or a tail onto a fresh directory) is written with
    ``store.rebase`` before the stream is journaled on top of it.
    Stream-only records (the batch's extras) go to ``on_record``.
    ``directory`` may be replaced by a snapshot: read it from the sink.
    """

    def __init__(self, directory: Directory, instance_id: str,
                 store: ReplicaStore | None = None,
                 make_directory: Callable[[], Directory] | None = None,
                 on_record: Callable[[list[Any]], None] | None = None,
                 log_: ReplicationLog | None = None,
                 context: zmq.Context | None = None,
                 curve: CurveConfig | None = None, based: bool = False) -> None:
        self.directory = directory
        self.curve = curve
        directory.journaling = False
        self.instance_id = instance_id
        self.store = store
        self.based = based and store is not None
        # journal frames received and not yet written, and their record count
        self._unwritten: list[bytes] = []
        self._unwritten_records = 0
        self._dirty = False  # records received (or a position changed) since the last write
        # batches received (written and acked by _settle) and not yet applied
        self._unapplied: collections.deque[Batch] = collections.deque()
        self._ack_due = False
        self._lazy_ack = False  # an ack the leader waits not for: sent within _LAZY_ACK_S
        self._last_ack = 0.0
        self._deferred: list[Any] | None = None  # a message after batches not yet applied
        self._taken = 0  # messages taken in this poll
        self._resync_due = False  # a gap or a malformed batch: hello again
        self.make_directory = make_directory or (lambda: Directory(directory.cfg))
        self.on_record = on_record
        self.log = log_ or ReplicationLog()
        self.known_epoch = 0  # the newest epoch seen (etcd or stream)
        self.leader_epoch = 0
        self.state = SinkState.CONNECTING
        self.stats = SinkStats()
        self.refusal = ""
        self._ctx = context  # ZeroMQ only (None: the process's shared context)
        self.conn: StandbyTransport | None = None
        self.endpoint = ""
        #: when the connection was lost (0.0: it was not): the caller dials again
        self.dropped_at = 0.0

    def position(self) -> StreamPosition:
        """The received position (the last record's epoch and lsn, the history);
        after :meth:`poll` returns, also the applied one."""
        lg = self.log
        return StreamPosition(lg.last_epoch, lg.last_lsn, list(lg.history))

    def _rebase(self) -> None:
        store = self.store
        if store is not None:
            self.based = store.rebase(self.directory, self.position())
            self._unwritten.clear()
            self._unwritten_records = 0
            self._dirty = False

    def _flush(self) -> None:
        """Write the records received since the last write and the position after them."""
        store = self.store
        if store is not None and self.based and self._dirty:
            store.commit_stream(self._unwritten, self._unwritten_records, self.position())
        self._unwritten.clear()
        self._unwritten_records = 0
        self._dirty = False

    def _settle(self, conn: StandbyTransport | None = None) -> None:
        """Write what was received (one write), acknowledge it (one ACK), then
        apply it: a batch is acked once the data dir holds it (once received
        without one), before it is applied, off the leader's critical path
        (applying follows at once, in this thread, before any promotion).
        With ``conn``: between slices of ``_APPLY_SLICE`` records, batches
        that arrived meanwhile are taken, written and acked first."""
        self._flush_and_ack()
        d = self.directory
        on_record = self.on_record
        while self._unapplied:
            b = self._unapplied.popleft()
            if b.frames:
                payloads = list(iter_frame_payloads(b.frames))
                for pi, payload in enumerate(payloads):
                    recs = decode_frame(payload)
                    for i in range(0, len(recs), _APPLY_SLICE):
                        for rec, exc in d.apply_records(recs[i:i + _APPLY_SLICE]
                                                        if len(recs) > _APPLY_SLICE else recs):
                            log.error("standby %s: bad record %r: %s", self.instance_id,
                                      rec[:2] if type(rec) is list else rec, exc)
                        # not after the last slice: the caller looks for batches next
                        if conn is not None and (self._unapplied or pi + 1 < len(payloads)
                                                 or i + _APPLY_SLICE < len(recs)) \
                                and self._intake(conn):
                            self._flush_and_ack()
            if on_record is not None:
                for rec in b.extras:
                    if type(rec) is list and rec:
                        on_record(rec)
            self.stats.batches += 1
            self.stats.records += b.length

    def _flush_and_ack(self) -> None:
        self._flush()
        if self._ack_due or (self._lazy_ack
                             and time.monotonic() - self._last_ack >= _LAZY_ACK_S):
            self._ack_due = self._lazy_ack = False
            if self.conn is not None and self.state is SinkState.STREAMING:
                self.conn.send(_pack([_ACK, self.leader_epoch, self.log.last_lsn]))
                self._last_ack = time.monotonic()

    def _intake(self, conn: StandbyTransport) -> int:
        """Take the batches waiting on ``conn`` (up to the first other message,
        kept in ``_deferred`` to be handled once every batch before it is
        applied); return messages taken."""
        n = 0
        while self._deferred is None and not self._resync_due and self.conn is conn \
                and self._taken < _SINK_DRAIN:
            parts = conn.recv()
            if parts is None:
                break
            n += 1
            self._taken += 1
            msg = _unpack(parts[0])
            if msg is None:
                continue
            if msg[0] == _BATCH:
                self._batch(msg, parts)
            else:
                self._deferred = msg
        return n

    @property
    def pollable(self) -> Any:
        """What the caller's poller (LoopPoller) watches (None: not connected)."""
        return self.conn.pollable if self.conn is not None else None

    @property
    def backlogged(self) -> bool:
        """Messages were read and not taken yet (a poll does not report them)."""
        return self.conn is not None and self.conn.buffered

    def _dropped(self) -> None:
        self.dropped_at = time.monotonic()

    def connect(self, endpoint: str, epoch: int) -> None:
        """Follow the leader of ``epoch`` at ``endpoint`` (``socket://HOST:PORT``,
        else a ZeroMQ address)."""
        self.known_epoch = max(self.known_epoch, epoch)
        self.leader_epoch = epoch
        self._unapplied.clear()  # never left queued past poll(); emptied for a resync
        self._ack_due = self._lazy_ack = False
        self._deferred = None
        if self.state is SinkState.SNAPSHOT:
            # an interrupted snapshot: the directory is partial, and the position
            # it was sent at is not ours; start from nothing (the data dir keeps
            # the state it had)
            self.directory = self.make_directory()
            self.directory.journaling = False
            self.log.reset(0, 0, [])
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.endpoint = endpoint
        self.dropped_at = 0.0
        self.stats.last_message = time.monotonic()
        if endpoint.startswith(SOCKET_SCHEME):
            if self.curve is not None and self.curve.active(host_of(endpoint)):
                # the leader serves its stream without CURVE: our policy wants it
                self.refusal = (f"the leader's stream {endpoint} is not encrypted and CURVE "
                                "is on for that host (replication_transport)")
                log.error("standby %s: %s", self.instance_id, self.refusal)
                self.state = SinkState.REFUSED
                return
            conn: StandbyTransport = SocketStandby(endpoint, self._dropped)
        else:
            conn = ZmqStandby(self._ctx or zmq.Context.instance(), endpoint, self.curve)
        self.conn = conn
        self.state = SinkState.CONNECTING
        conn.send(_pack([MsgType.HELLO, self.instance_id, self.known_epoch,
                         self.log.last_epoch, self.log.last_lsn, REPLICATION_PROTOCOL]))

    def observe_epoch(self, epoch: int) -> None:
        """etcd told us of term ``epoch``: refuse anything older from now on."""
        self.known_epoch = max(self.known_epoch, epoch)

    def poll(self, timeout_s: float = 0.0, ready: bool | None = None) -> int:
        """Apply what arrived within ``timeout_s``; return messages handled.
        ``ready``: the caller's poll just said whether :attr:`pollable` has
        messages (no look of its own then, ``timeout_s`` unused)."""
        conn = self.conn
        if conn is None:
            if ready is None:
                time.sleep(timeout_s)
            return 0
        conn.flush()  # a hello sent while the connection was being set up
        if not (ready or conn.buffered if ready is not None else conn.wait(int(timeout_s * 1000))):
            if self._lazy_ack:
                self._flush_and_ack()  # when due
            return 0
        self._taken = 0
        while True:
            taken = self._intake(conn)
            self._settle(conn)
            if self._resync_due:
                self._resync_due = False
                self.state = SinkState.CONNECTING
                self.connect(self.endpoint, self.leader_epoch)
                break
            msg = self._deferred
            if msg is not None:  # every batch before it is applied
                self._deferred = None
                self._handle(msg)
                self._settle(conn)
            elif not taken:
                break
            if self.conn is not conn:
                break
            if self._taken >= _SINK_DRAIN and self._deferred is None \
                    and not self._resync_due:
                break  # the rest next time (nothing taken is left unhandled)
        return self._taken

    def _refuse(self, message: str) -> None:
        self.stats.refused += 1
        self.refusal = message
        log.warning("standby %s: %s", self.instance_id, message)
        if self.conn is not None:
            self.conn.send(_pack([MsgType.REFUSE, int(ErrorCode.STALE_EPOCH), message,
                                  self.known_epoch]))
        self.state = SinkState.REFUSED

    def _handle(self, msg: list[Any]) -> None:
        """Apply one message other than a batch (after every batch before it)."""
        kind = msg[0]
        epoch = msg[1] if len(msg) > 1 else None
        self.stats.last_message = time.monotonic()
        if kind == MsgType.REFUSE:
            self.refusal = str(msg[2]) if len(msg) > 2 else ""
            self.state = SinkState.REFUSED
            if len(msg) > 3 and type(msg[3]) is int:
                self.known_epoch = max(self.known_epoch, msg[3])
            return
        if type(epoch) is not int:
            return
        if epoch < self.known_epoch:
            self._refuse(f"message of epoch {epoch} after epoch {self.known_epoch}")
            return
        if kind == MsgType.HEARTBEAT:
            return
        if kind == MsgType.TAIL:
            self.known_epoch = max(self.known_epoch, epoch)
            self.log.adopt_history(msg[3])
            self.state = SinkState.STREAMING
            if self.store is not None and not self.based:
                self._rebase()  # a fresh directory: the data dir's old state goes
            self._dirty = True  # the history may have changed
            self._ack_due = True
            return
        if kind == MsgType.SNAP_BEGIN:
            self.known_epoch = max(self.known_epoch, epoch)
            if self.store is not None:
                # the data dir keeps the old state until SNAP_END writes the new one
                self.store.discard_snapshot()
                self.based = False
                self._unwritten.clear()
                self._unwritten_records = 0
            d = self.make_directory()
            d.journaling = False
            for wire in msg[3]:
                d.restore_segment(wire)
            self.directory = d
            self.log.reset(epoch, int(msg[2]), msg[4])
            self.state = SinkState.SNAPSHOT
            return
        if kind == MsgType.SNAP_CHUNK and self.state is SinkState.SNAPSHOT:
            restore = self.directory.replay.restore_object
            for key, size, flags, checksum, wire in msg[2]:
                restore(key, int(size), int(flags), checksum, list(wire))
            return
        if kind == MsgType.SNAP_END and self.state is SinkState.SNAPSHOT:
            self.stats.snapshots += 1
            self.state = SinkState.STREAMING
            log.info("standby %s: snapshot applied (%d objects, lsn %d)", self.instance_id,
                     len(self.directory.objects), self.log.last_lsn)
            self._rebase()
            self._ack_due = True

    def _batch(self, msg: list[Any], parts: list[bytes]) -> None:
        """Take one batch: checked and logged now; written, acked and applied
        by :meth:`_settle`."""
        self.stats.last_message = time.monotonic()
        epoch = msg[1] if len(msg) > 1 else None
        if type(epoch) is not int:
            return
        if epoch < self.known_epoch:
            self._refuse(f"batch of epoch {epoch} after epoch {self.known_epoch}")
            return
        if len(msg) != 7 or len(parts) > 2 or type(msg[2]) is not int \
                or type(msg[3]) is not int or type(msg[4]) is not int \
                or type(msg[5]) is not list:
            return
        _t, _e, first, count, rec_epoch, extras, urgent = msg
        if self.state is SinkState.CONNECTING or self.state is SinkState.REFUSED \
                or self._resync_due:
            return
        last = self.log.last_lsn
        if first != last + 1:
            if first + count - 1 <= last:
                return  # a repeat of what we hold
            log.warning("standby %s: gap (have %d, got %d): resyncing", self.instance_id,
                        last, first)
            self._resync()
            return
        frames = parts[1] if len(parts) == 2 else b""  # an empty part may be left out
        n_dir = check_frames(frames) if frames else 0
        if n_dir < 0 or n_dir + len(extras) != count:
            log.error("standby %s: malformed batch at lsn %d (%d records said, %d held): "
                      "resyncing", self.instance_id, first, count, n_dir + len(extras))
            self._resync()
            return
        self.known_epoch = max(self.known_epoch, epoch)
        b = Batch(rec_epoch, first, count, frames, extras)
        self.log.append(b)
        if self.based and frames:
            self._unwritten.append(frames)
            self._unwritten_records += n_dir
        self._dirty = True
        self._unapplied.append(b)
        if self.state is SinkState.STREAMING:
            if urgent:
                self._ack_due = True
            else:
                self._lazy_ack = True

    def _resync(self) -> None:
        """Say hello again from what we hold, once what was received before is
        applied (:meth:`poll`); nothing more is taken from this socket."""
        self._resync_due = True

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def promote_directory(d: Directory, now: float | None = None) -> int:
    """Make a standby's directory serve: every replicated segment active, its
    owner treated as just seen (it has ``client_ttl`` to ping the new
    leader), journaling on. Return the number of segments activated."""
    t = d.clock() if now is None else now
    n = 0
    for seg in d.segments.values():
        if seg.state == SegState.AWAITING:
            d.segtab.activate(seg)
            n += 1
        d.clients[seg.owner] = t
    d.segtab.awaiting.clear()
    d.journaling = True
    d.records.clear()
    return n
