"""A standby's end of journal replication (:mod:`.replication`): follows one
leader, writes what it sends to the data dir, acknowledges it, applies it to
a directory held in memory (:meth:`Directory.apply_records`); and what makes
that directory serve once the standby is elected (:func:`promote_directory`)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import zmq

from kvpool.core.auth import CurveConfig
from kvpool.core.errors import ErrorCode
from kvpool.master.directory import Directory, SegState
from kvpool.master.durability import StreamPosition
from kvpool.master.ha.replication import (
    ACK,
    BATCH,
    REPLICATION_PROTOCOL,
    Batch,
    MsgType,
    ReplicationLog,
    pack,
    unpack,
)
from kvpool.master.ha.transport import (
    SOCKET_SCHEME,
    SocketStandby,
    StandbyTransport,
    ZmqStandby,
    host_of,
)
from kvpool.master.journal import check_frames, iter_frame_payloads
from kvpool.master.records import decode_frame

__all__ = ["ReplicaSink", "ReplicaStore", "SinkState", "SinkStats", "promote_directory"]

log = logging.getLogger(__name__)

#: messages a standby takes in one go (one write and one ack for the batches
#: among them) before it writes, acks and applies what it has
SINK_DRAIN = 256
#: records a standby applies between two looks for new batches (which it then
#: writes and acks before it applies on): a batch's ack never waits for the
#: whole apply of the one before
APPLY_SLICE = 128
#: a standby whose acks hold no reply (not in the in-sync set) acks at most
#: this often: the leader wakes for the acks that release replies
LAZY_ACK_S = 0.01

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
    together (up to ``SINK_DRAIN`` messages) is checked, then, with a
    ``store``, written to the data dir in one write (the leader's journal
    frames as they are, and the position after them), then acknowledged with
    one ACK, then decoded and applied to the directory (``journaling`` off:
    they are the leader's records) ``APPLY_SLICE`` records at a time
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
        self._lazy_ack = False  # an ack the leader waits not for: sent within LAZY_ACK_S
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
        With ``conn``: between slices of ``APPLY_SLICE`` records, batches
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
                    for i in range(0, len(recs), APPLY_SLICE):
                        for rec, exc in d.apply_records(recs[i:i + APPLY_SLICE]
                                                        if len(recs) > APPLY_SLICE else recs):
                            log.error("standby %s: bad record %r: %s", self.instance_id,
                                      rec[:2] if type(rec) is list else rec, exc)
                        # not after the last slice: the caller looks for batches next
                        if conn is not None and (self._unapplied or pi + 1 < len(payloads)
                                                 or i + APPLY_SLICE < len(recs)) \
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
                             and time.monotonic() - self._last_ack >= LAZY_ACK_S):
            self._ack_due = self._lazy_ack = False
            if self.conn is not None and self.state is SinkState.STREAMING:
                self.conn.send(pack([ACK, self.leader_epoch, self.log.last_lsn]))
                self._last_ack = time.monotonic()

    def _intake(self, conn: StandbyTransport) -> int:
        """Take the batches waiting on ``conn`` (up to the first other message,
        kept in ``_deferred`` to be handled once every batch before it is
        applied); return messages taken."""
        n = 0
        while self._deferred is None and not self._resync_due and self.conn is conn \
                and self._taken < SINK_DRAIN:
            parts = conn.recv()
            if parts is None:
                break
            n += 1
            self._taken += 1
            msg = unpack(parts[0])
            if msg is None:
                continue
            if msg[0] == BATCH:
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
        conn.send(pack([MsgType.HELLO, self.instance_id, self.known_epoch,
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
            if self._taken >= SINK_DRAIN and self._deferred is None \
                    and not self._resync_due:
                break  # the rest next time (nothing taken is left unhandled)
        return self._taken

    def _refuse(self, message: str) -> None:
        self.stats.refused += 1
        self.refusal = message
        log.warning("standby %s: %s", self.instance_id, message)
        if self.conn is not None:
            self.conn.send(pack([MsgType.REFUSE, int(ErrorCode.STALE_EPOCH), message,
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
            # answered with an ack: the leader tells an idle standby from a
            # silent one (a frozen process, a host gone without closing)
            self._ack_due = True
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
            if len(msg) > 5:  # the leader's live tenant quotas
                d.tenants.load_live(msg[5])
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
    d.tenants.rebuild(d.objects, d.objects.pending)  # usage as the objects say
    return n
