"""The master's event stream: committed directory changes on a ZeroMQ PUB socket.

The publisher is a commit listener (:meth:`Durability.add_listener`): it
translates each group commit's journal records into events
(:mod:`kvpool.core.events`) on the loop thread, after the records were
written (journaled when there is a ``data_dir``; the same records flow
without one), and :meth:`EventPublisher.flush` sends what the ack gate
allows once per loop turn, after that turn's replies:

======================  ==========================================
journal record          event
======================  ==========================================
MOUNT                   SegmentAdded (tier, host, size)
DROP_SEGMENT            SegmentRemoved (its replicas are gone)
PUT                     ObjectStored (the key's whole replica set:
                        a new object, an offload to disk, a promotion)
REMOVE                  ObjectRemoved (remove, last replica evicted)
DROP_REPLICA            ReplicaRemoved (one tier's copy evicted)
======================  ==========================================

Sending never blocks the loop: the socket is XPUB (a PUB that also reads
subscriptions: a new subscriber is greeted with a heartbeat at once), each
subscriber has its own queue of ``events_hwm`` messages, and a subscriber
whose queue is full misses messages (it sees a seq gap and resyncs) while
the others get them.
ZeroMQ drops silently; to count, the socket runs with ``XPUB_NODROP``: a
send that finds a full queue fails, is counted in ``overflows`` and is sent
again lossily. A queue already full is skipped by ZeroMQ without a
failure, so ``overflows`` counts the starts of drop runs, not every message
lost. A batch holds at most ``MAX_EVENTS`` events (a bigger turn is split
over consecutive seqs).

HA: ``term`` (a callable the HA wiring sets) returns the leader's epoch
while this master serves as leader and None otherwise; a master that is
not the leader publishes nothing and discards what it translated.

:func:`list_objects` serves ``LIST_OBJECTS`` (the resync listing), one page
of whole directory shards at a time so no page stalls the loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.events import (
    HEARTBEAT_S,
    Event,
    EventBatch,
    ObjectRemoved,
    ObjectStored,
    Replica,
    ReplicaRemoved,
    SegmentAdded,
    SegmentRemoved,
    Tier,
    encode_message,
)
from kvpool.core.protocol import ListObjects, ListObjectsReply, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.records import DirRecord, DropReplica, DropSegment, Mount, Put, Remove
from kvpool.master.segments import SegState

__all__ = ["MAX_EVENTS", "EventPublisher", "list_objects"]

log = logging.getLogger(__name__)

#: Events per message at most; a loop turn with more is split over several seqs.
MAX_EVENTS = 1000

_TIERS = {SegmentKind.MEMORY: Tier.DRAM, SegmentKind.FILE: Tier.DISK}
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_JOIN_CHECK_S = 0.01  # how often new subscriptions are looked for (and greeted)
_POLLIN = int(zmq.POLLIN)
_DEAD = SegState.DEAD


def _no_ha() -> int | None:
    return 0


class EventPublisher:
    """The PUB socket and the translation of commits into event batches.

    Binds ``tcp://{cfg.host}:{cfg.events_port}`` on ``context`` (CURVE as
    the RPC socket: same keys and allow-list). Loop thread only, except
    :meth:`stats` and :meth:`position` (plain reads).
    """

    def __init__(self, cfg: MasterConfig, context: zmq.Context[Any],
                 directory: Directory) -> None:
        self.dir = directory
        #: HA hook: the epoch while this master is the serving leader, None otherwise
        self.term: Callable[[], int | None] = _no_ha
        self.stream = secrets.randbits(63) or 1
        self.seq = 0
        self.batches = 0
        self.events = 0
        self.overflows = 0
        self.heartbeats = 0
        self.subscriptions = 0
        self._pending: list[tuple[int, list[Event]]] = []
        self._last_send = time.monotonic()
        self._next_join_check = 0.0
        # segment id -> the Replica its replicas are announced as (one shared instance)
        self._replicas: dict[str, Replica] = {}
        self.rebind_directory(directory)
        # XPUB: a PUB that also reads subscriptions, so a new subscriber is
        # greeted with a heartbeat at once (it knows its subscription is live)
        self.sock = context.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, cfg.events_hwm)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue fails the send: counted
        self._auth = cfg.curve.setup_server(self.sock, cfg.host)
        try:
            self.sock.bind(f"tcp://{cfg.host}:{cfg.events_port}")
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = f"tcp://{cfg.host}:{cfg.events_port}"
        log.info("events on %s (CURVE %s)", self.endpoint, "on" if self._auth else "off")

    # ================================================================ translation
    def rebind_directory(self, directory: Directory) -> None:
        """Serve ``directory`` from now on (HA: a promoted standby's directory)."""
        self.dir = directory
        self._replicas = {seg.id: Replica(seg.id, _TIERS[seg.kind])
                          for seg in directory.segments.values()}

    def _replica(self, sid: str) -> Replica | None:
        rep = self._replicas.get(sid)
        if rep is None:  # e.g. a standby promoted with segments it learned by replication
            seg = self.dir.segments.get(sid)
            if seg is None:
                return None
            rep = self._replicas[sid] = Replica(sid, _TIERS[seg.kind])
        return rep

    def on_commit(self, records: Sequence[DirRecord], commit_no: int) -> None:
        """Durability listener: translate one group commit (loop thread)."""
        out: list[Event] = []
        try:
            self._translate(records, out)
        except Exception:  # a listener must not raise into the commit: resync them
            log.exception("events: cannot translate a commit; publishing a new stream")
            self.stream = secrets.randbits(63) or 1
            self.seq = 0
        if out:
            self._pending.append((commit_no, out))

    def _translate(self, records: Sequence[DirRecord], out: list[Event]) -> None:
        append = out.append
        replica = self._replica
        for rec in records:
            if isinstance(rec, Put):
                reps = [r for r in map(replica, rec.replicas[::2]) if r is not None]
                append(ObjectStored(rec.key, rec.size, reps))
            elif isinstance(rec, Remove):
                append(ObjectRemoved(rec.key))
            elif isinstance(rec, DropReplica):
                append(ReplicaRemoved(rec.key, rec.segment_id))
            elif isinstance(rec, Mount):
                w = rec.segment
                tier = _TIERS[SegmentKind(int(w["kind"]))]
                sid = str(w["segment_id"])
                self._replicas[sid] = Replica(sid, tier)
                append(SegmentAdded(sid, tier, str(w["host_id"]), int(w["size"])))
            elif isinstance(rec, DropSegment):
                self._replicas.pop(rec.segment_id, None)
                append(SegmentRemoved(rec.segment_id))

    # ================================================================ sending
    def flush(self, acked: int, now: float) -> None:
        """Send the events of commits up to ``acked`` (the ack gate) as one
        batch (split at MAX_EVENTS), or a heartbeat after HEARTBEAT_S idle or
        when a subscriber joined."""
        if now >= self._next_join_check:  # a getsockopt costs ~1.5 us: not every turn
            self._next_join_check = now + _JOIN_CHECK_S
            if self.sock.get(_EVENTS) & _POLLIN and self._joined():
                self._last_send = now - HEARTBEAT_S  # greet it now
        pending = self._pending
        if not pending:
            if now - self._last_send >= HEARTBEAT_S:
                epoch = self.term()
                if epoch is not None:
                    self.heartbeats += 1
                    self._send([], epoch, self.seq)
                self._last_send = now
            return
        epoch = self.term()
        if epoch is None:  # not the serving leader: nothing is published
            pending.clear()
            return
        n = 0
        while n < len(pending) and pending[n][0] <= acked:
            n += 1
        if not n:
            return
        if n == 1:
            events = pending[0][1]
        else:
            events = [ev for _c, evs in pending[:n] for ev in evs]
        del pending[:n]
        for i in range(0, len(events), MAX_EVENTS):
            chunk = events[i:i + MAX_EVENTS] if len(events) > MAX_EVENTS else events
            self.seq += 1
            self.batches += 1
            self.events += len(chunk)
            self._send(chunk, epoch, self.seq)
        self._last_send = now

    def _joined(self) -> bool:
        """Read the subscription messages; whether one was a new subscription."""
        joined = False
        sock = self.sock
        while sock.get(_EVENTS) & _POLLIN:
            msg = sock.recv(_NOBLOCK)
            if msg[:1] == b"\x01":
                self.subscriptions += 1
                joined = True
        return joined

    def _send(self, events: list[Event], epoch: int, seq: int) -> None:
        msg = encode_message(EventBatch(seq, self.stream, epoch, time.time(), events))
        sock = self.sock
        try:
            sock.send(msg, _NOBLOCK)
        except zmq.Again:
            # a subscriber's queue is full: it misses this one (and sees the gap);
            # the others still get it
            self.overflows += 1
            sock.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                sock.send(msg, _NOBLOCK)
            except zmq.ZMQError:
                pass
            finally:
                sock.setsockopt(zmq.XPUB_NODROP, 1)
        except zmq.ZMQError as exc:
            log.warning("events: send failed: %s", exc)

    # ================================================================ readers
    def position(self) -> tuple[int, int, int]:
        """(stream, last seq sent, epoch): where a listing taken now stands."""
        return self.stream, self.seq, self.term() or 0

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "events": self.events, "overflows": self.overflows,
                "heartbeats": self.heartbeats, "subscriptions": self.subscriptions,
                "seq": self.seq}

    def close(self) -> None:
        self.sock.close(0)
        if self._auth is not None:
            self._auth.close()
            self._auth = None


def list_objects(d: Directory, req: ListObjects,
                 position: tuple[int, int, int]) -> ListObjectsReply:
    """One page of ``LIST_OBJECTS``: the objects of whole shards from
    ``req.cursor`` on, until about ``req.limit`` objects (one shard at least),
    with their live replicas; every segment on the first page."""
    shards = d.objects.shards
    cursor = req.cursor
    if not 0 <= cursor < len(shards):
        raise KVPoolError(f"cursor {cursor} out of range [0, {len(shards)})",
                          ErrorCode.INVALID_PARAMS)
    if req.limit <= 0:
        raise KVPoolError("limit must be > 0", ErrorCode.INVALID_PARAMS)
    prefix = req.prefix
    replicas: dict[str, Replica] = {}
    out: list[ObjectStored] = []
    i = cursor
    while i < len(shards) and len(out) < req.limit:
        for key, obj in shards[i].items():
            if prefix and not key.startswith(prefix):
                continue
            reps: list[Replica] = []
            flat = obj.replicas
            for j in range(0, len(flat), 2):
                seg = flat[j]
                if seg.state == _DEAD:
                    continue
                rep = replicas.get(seg.id)
                if rep is None:
                    rep = replicas[seg.id] = Replica(seg.id, _TIERS[seg.kind])
                reps.append(rep)
            if reps:
                out.append(ObjectStored(key, obj.size, reps))
        i += 1
    segments: list[SegmentAdded] = []
    if cursor == 0:
        segments = [SegmentAdded(s.id, _TIERS[s.kind], s.desc.host_id, s.desc.size)
                    for s in d.segments.values()]
    stream, seq, epoch = position
    return ListObjectsReply(out, segments, i if i < len(shards) else 0, stream, seq, epoch)
