"""The leader's end of journal replication (:mod:`.replication`): publishes
each group commit to every connected standby, tracks their acks and the
in-sync set's position, and brings a joining standby up to date with a
tail of the log or a snapshot streamed in slices between loop turns."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import zmq

from kvpool.core.auth import CurveConfig
from kvpool.core.errors import ErrorCode
from kvpool.master.directory import Directory
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
from kvpool.master.ha.transport import SOCKET_SCHEME, LeaderTransport, SocketLeader, ZmqLeader
from kvpool.master.journal import encode_frames

__all__ = ["ReplicationSource", "StandbyState", "StandbyStatus"]

log = logging.getLogger(__name__)

#: a standby being sent a snapshot gets its next slice only once the kernel
#: took all but this much of what it was sent (the socket transport's buffer)
_SNAPSHOT_BACKLOG = 8 << 20

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
    # when it last acked anything (heartbeats too; 0.0: not since its hello,
    # e.g. while it loads a snapshot), and whether it has been silent past
    # ``silent_s`` (not counted as connected, lagging when in sync)
    heard: float = 0.0
    silent: bool = False


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
                 listener: socket.socket | None = None, silent_s: float = 1.0) -> None:
        self.dir = directory
        self.epoch = epoch
        self.log = log_ or ReplicationLog()
        self.log.start_epoch(epoch)
        self.snapshot_slice_s = snapshot_slice_s
        self.heartbeat_s = heartbeat_s
        self.silent_s = silent_s
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
        self._drops_seen = 0  # transport.drops when last looked at
        self._next_silence_check = 0.0
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
                out.append((pack([BATCH, self.epoch, first, last.last - first + 1,
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
        (or are gone, or silent): candidates to remove (after etcd says so). Owing
        starts at the later of its last ack and the send of the first batch
        it has not acked."""
        now = time.monotonic()
        last = self.log.last_lsn
        out = []
        for m in self.sync_members:
            sb = self.standbys.get(m)
            if sb is None or sb.silent or (sb.status.acked_lsn < last and now - max(
                    sb.status.last_ack, sb.owed_since) > timeout_s):
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
                msg = unpack(data)
                if msg is not None:
                    handle(ident, msg)
        if self.transport.drops != self._drops_seen:
            self._forget_gone()
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
            frame = pack([MsgType.HEARTBEAT, self.epoch, self.log.last_lsn])
            for sb in self.standbys.values():
                self._send(sb.ident, frame)
        if now >= self._next_silence_check:
            self._next_silence_check = now + self.heartbeat_s
            self._mark_silent(now)
        return n

    def _mark_silent(self, now: float) -> None:
        """Mark the standbys that acked nothing, not even a heartbeat, for
        ``silent_s`` (frozen, or their host went without closing the
        connection): they do not count as :meth:`connected` and an in-sync
        one is :meth:`lagging`, so the leader learns it has too few standbys
        before the next write, not by applying it and waiting for an ack.
        One loading a snapshot has not acked since its hello and is spared;
        the next ack of one clears the mark."""
        limit = self.silent_s
        for sid, sb in self.standbys.items():
            if not sb.silent and sb.heard and now - sb.heard > limit and sb.chunks is None:
                sb.silent = True
                log.warning("standby %s: silent for %.1f s (no ack, not even of a heartbeat)",
                            sid, now - sb.heard)

    def connected(self) -> int:
        """Standbys connected and heard from within ``silent_s``."""
        return sum(1 for sb in self.standbys.values() if not sb.silent)

    def _refuse(self, ident: Any, code: ErrorCode, message: str) -> None:
        self._send(ident, pack([MsgType.REFUSE, int(code), message, self.epoch]))

    def _handle(self, ident: Any, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == ACK and len(msg) == 3:  # the common message first
            _t, epoch, lsn = msg
            sb = self._by_ident(ident)
            if sb is None or epoch != self.epoch or type(lsn) is not int:
                return
            sb.heard = now = time.monotonic()
            if sb.silent:
                sb.silent = False
                log.info("standby %s: heard again", sb.status.instance_id)
            if sb.chunks is None and lsn > sb.status.acked_lsn:
                sb.status.acked_lsn = min(lsn, self.log.last_lsn)
                sb.status.last_ack = now
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

    def _forget_gone(self) -> None:
        """Forget the standbys whose connection closed (killed, or it broke):
        an in-sync member among them is :meth:`lagging` at once, so the
        leader drops it from the set without waiting ``sync_timeout_s`` for
        an ack it will never get (and learns it has too few standbys before
        the next write comes, not after applying it). One that dials again
        says hello and joins anew."""
        transport = self.transport
        self._drops_seen = transport.drops
        gone = transport.gone
        for sid, sb in list(self.standbys.items()):
            if gone(sb.ident):
                log.warning("standby %s: its connection closed", sid)
                self._forget(sid)

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
            self._send(ident, pack([MsgType.TAIL, self.epoch, last_lsn + 1, self.log.history]))
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
        self._send(ident, pack([MsgType.SNAP_BEGIN, self.epoch, self.log.last_lsn,
                                 d.segtab.wires(), self.log.history,
                                 d.tenants.live_records()]))
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
                self._send(sb.ident, pack([MsgType.SNAP_END, self.epoch, self.log.last_lsn,
                                            sb.snap_count]))
                sb.chunks = None
                self._count_snapshots()
                sb.status.state = StandbyState.STREAMING
                sb.status.last_ack = time.monotonic()
                return
            recs = [r for r in map(record_of, keys) if r is not None]
            sb.snap_count += len(recs)
            if recs:
                self._send(sb.ident, pack([MsgType.SNAP_CHUNK, self.epoch, recs]))

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
