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

Tenants (docs/tenants.md): the default tenant's events go on ``TOPIC`` as
they always did; a tenant's on its own topic (:func:`kvpool.core.events.topic`),
keys as it names them, with its own ``seq``, and only while someone
subscribes to it (the XPUB reads subscriptions; a new subscriber is greeted,
then lists, so nothing before its subscription is owed to it). Segment
events go on every topic published. The default tenant's path pays one
comparison per key.

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
    TOPIC,
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
    topic,
)
from kvpool.core.protocol import ListObjects, ListObjectsReply, SegmentKind
from kvpool.core.tenants import DEFAULT_TENANT, TENANT_SEP, split_scoped, tenant_name
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


class _TenantTopic:
    """A tenant's topic: its seq, when it last sent, whether subscribed now."""

    __slots__ = ("last_send", "seq", "subscribed", "topic")

    def __init__(self, tenant: str) -> None:
        self.topic = topic(tenant)
        self.seq = 0
        self.last_send = 0.0
        self.subscribed = True


#: A key below this is a tenant's stored key (default keys start at U+0020).
_KEY_MIN = " "


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
        self.refused = 0  # subscriptions refused under tenant_keys
        # (commit, the default tenant's events, the tenants' events: (tenant, event)
        # of a subscribed tenant, (None, event) for every one)
        self._pending: list[tuple[int, list[Event], list[tuple[str | None, Event]]]] = []
        self._tenants: dict[str, _TenantTopic] = {}  # tenants subscribed to (or once)
        self._subscribed = 0  # how many of those are subscribed now
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
        # tenant_keys: a subscription takes effect only when the subscriber's
        # CURVE key may act as the tenant of its topic (see _joined)
        self._allowed: dict[str, frozenset[str]] | None = None
        if cfg.tenant_keys:
            self._allowed = cfg.tenant_key_sets()
            self.sock.setsockopt(zmq.XPUB_MANUAL, 1)
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
        others: list[tuple[str | None, Event]] = []
        try:
            self._translate(records, out, others)
        except Exception:  # a listener must not raise into the commit: resync them
            log.exception("events: cannot translate a commit; publishing a new stream")
            self.stream = secrets.randbits(63) or 1
            self.seq = 0
            for t in self._tenants.values():
                t.seq = 0
        if out or others:
            self._pending.append((commit_no, out, others))

    def _translate(self, records: Sequence[DirRecord], out: list[Event],
                   others: list[tuple[str | None, Event]]) -> None:
        """Translate ``records``: the default tenant's events into ``out``,
        subscribed tenants' (and, while any is, segment events) into
        ``others``."""
        append = out.append
        replica = self._replica
        tenants = self._tenants if self._subscribed else None
        for rec in records:
            ev: Event
            if isinstance(rec, Put):
                key = rec.key
                reps = [r for r in map(replica, rec.replicas[::2]) if r is not None]
                if key < _KEY_MIN:  # a tenant's
                    self._other(key, others, ObjectStored, rec.size, reps)
                else:
                    append(ObjectStored(key, rec.size, reps))
                continue
            if isinstance(rec, Remove):
                if rec.key < _KEY_MIN:
                    self._other(rec.key, others, ObjectRemoved)
                else:
                    append(ObjectRemoved(rec.key))
                continue
            if isinstance(rec, DropReplica):
                if rec.key < _KEY_MIN:
                    self._other(rec.key, others, ReplicaRemoved, rec.segment_id)
                else:
                    append(ReplicaRemoved(rec.key, rec.segment_id))
                continue
            if isinstance(rec, Mount):
                w = rec.segment
                tier = _TIERS[SegmentKind(int(w["kind"]))]
                sid = str(w["segment_id"])
                self._replicas[sid] = Replica(sid, tier)
                ev = SegmentAdded(sid, tier, str(w["host_id"]), int(w["size"]))
            elif isinstance(rec, DropSegment):
                self._replicas.pop(rec.segment_id, None)
                ev = SegmentRemoved(rec.segment_id)
            else:
                continue
            append(ev)
            if tenants is not None:
                others.append((None, ev))

    def _other(self, stored: str, others: list[tuple[str | None, Event]], kind: Any,
               *args: Any) -> None:
        """A tenant's event (``kind(key, *args)``, its key as the tenant names
        it) into ``others`` when the tenant is subscribed."""
        tenant, key = split_scoped(stored)
        t = self._tenants.get(tenant)
        if t is not None and t.subscribed:
            others.append((tenant, kind(key, *args)))

    # ================================================================ sending
    def flush(self, acked: int, now: float) -> None:
        """Send the events of commits up to ``acked`` (the ack gate) as one
        batch (split at MAX_EVENTS), or a heartbeat after HEARTBEAT_S idle or
        when a subscriber joined."""
        if now >= self._next_join_check:  # a getsockopt costs ~1.5 us: not every turn
            self._next_join_check = now + _JOIN_CHECK_S
            if self.sock.get(_EVENTS) & _POLLIN and self._joined():
                self._last_send = now - HEARTBEAT_S  # greet it now
                for t in self._tenants.values():
                    t.last_send = now - HEARTBEAT_S
        if self._subscribed:
            self._tenant_heartbeats(now)
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
            events = [ev for _c, evs, _o in pending[:n] for ev in evs]
        others = [x for _c, _e, o in pending[:n] if o for x in o]
        del pending[:n]
        if events:
            self.seq = self._send_chunks(events, epoch, self.seq)
            self._last_send = now
        if others:
            self._flush_tenants(others, epoch, now)

    def _send_chunks(self, events: list[Event], epoch: int, seq: int,
                     topic_: bytes = TOPIC) -> int:
        """Send ``events`` on ``topic_`` as batches after ``seq``; the last seq."""
        for i in range(0, len(events), MAX_EVENTS):
            chunk = events[i:i + MAX_EVENTS] if len(events) > MAX_EVENTS else events
            seq += 1
            self.batches += 1
            self.events += len(chunk)
            self._send(chunk, epoch, seq, topic_)
        return seq

    def _flush_tenants(self, others: list[tuple[str | None, Event]], epoch: int,
                       now: float) -> None:
        """Send the tenants' events: each subscribed tenant's own and every
        segment event, in commit order, on its topic."""
        by_tenant: dict[str, list[Event]] = {}
        live = [name for name, t in self._tenants.items() if t.subscribed]
        for tenant, ev in others:
            if tenant is None:
                for name in live:
                    by_tenant.setdefault(name, []).append(ev)
            elif tenant in live:
                by_tenant.setdefault(tenant, []).append(ev)
        for name, events in by_tenant.items():
            t = self._tenants[name]
            t.seq = self._send_chunks(events, epoch, t.seq, t.topic)
            t.last_send = now

    def _tenant_heartbeats(self, now: float) -> None:
        """A heartbeat on each subscribed tenant's topic idle for HEARTBEAT_S."""
        epoch: int | None = -1
        for t in self._tenants.values():
            if t.subscribed and now - t.last_send >= HEARTBEAT_S:
                if epoch == -1:
                    epoch = self.term()
                if epoch is not None:
                    self.heartbeats += 1
                    self._send([], epoch, t.seq, t.topic)
                t.last_send = now

    def _joined(self) -> bool:
        """Read the subscription messages; whether one was a new subscription.
        A tenant's topic is published while subscribed."""
        joined = False
        sock = self.sock
        while sock.get(_EVENTS) & _POLLIN:
            if self._allowed is not None:
                msg = self._checked_subscription()
                if msg is None:
                    continue
            else:
                msg = sock.recv(_NOBLOCK)
            if msg[1:2] == b"\x1f" and msg[-1:] == b"\x1f" and len(msg) > 3:
                self._tenant_subscription(msg[2:-1], msg[:1] == b"\x01")
            if msg[:1] == b"\x01":
                self.subscriptions += 1
                joined = True
        return joined

    def _checked_subscription(self) -> bytes | None:
        """Under ``tenant_keys`` (XPUB_MANUAL: no subscription applies by
        itself): read one subscription message and apply it when the
        subscriber's CURVE key may follow its topic: the default tenant's
        (anyone), or a tenant's whose ``tenant_keys`` list the key. Any
        other prefix (``b""``, ``b"\\x1f"``: every tenant's topic) is
        refused: the message, or None when refused."""
        frame = self.sock.recv(_NOBLOCK, copy=False)
        msg = frame.bytes
        if msg[:1] not in (b"\x00", b"\x01"):
            return None
        prefix = msg[1:]
        ok = prefix == TOPIC
        if not ok and len(prefix) > 2 and prefix[:1] == prefix[-1:] == b"\x1f":
            try:
                tenant = tenant_name(prefix[1:-1].decode())
                peer = frame.get("User-Id")
            except (UnicodeDecodeError, KVPoolError, zmq.ZMQError):
                tenant, peer = "", None
            assert self._allowed is not None
            ok = tenant == "default" or (
                isinstance(peer, str) and peer in self._allowed.get(tenant, ()))
        if not ok:
            if msg[:1] == b"\x01":
                self.refused += 1
                log.warning("events: refused a subscription to %r: the subscriber's key may "
                            "not follow it (tenant_keys)", prefix[:64])
            return None
        self.sock.setsockopt(zmq.SUBSCRIBE if msg[:1] == b"\x01" else zmq.UNSUBSCRIBE, prefix)
        return msg

    def _tenant_subscription(self, name: bytes, on: bool) -> None:
        """The last subscriber of tenant ``name``'s topic came (``on``) or left."""
        try:
            tenant = tenant_name(name.decode())
        except (UnicodeDecodeError, KVPoolError):
            return  # no tenant's topic: nothing is published on it
        t = self._tenants.get(tenant)
        if t is None:
            if not on:
                return
            t = self._tenants[tenant] = _TenantTopic(tenant)
        elif t.subscribed == on:
            return
        t.subscribed = on
        self._subscribed += 1 if on else -1

    def _send(self, events: list[Event], epoch: int, seq: int, topic_: bytes = TOPIC) -> None:
        msg = encode_message(EventBatch(seq, self.stream, epoch, time.time(), events), topic_)
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
    def position(self, tenant: str = DEFAULT_TENANT) -> tuple[int, int, int]:
        """(stream, last seq sent on ``tenant``'s topic, epoch): where a
        listing of ``tenant``'s objects taken now stands."""
        if tenant == DEFAULT_TENANT:
            return self.stream, self.seq, self.term() or 0
        t = self._tenants.get(tenant)
        return self.stream, t.seq if t is not None else 0, self.term() or 0

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "events": self.events, "overflows": self.overflows,
                "heartbeats": self.heartbeats, "subscriptions": self.subscriptions,
                "refused": self.refused, "seq": self.seq}

    def close(self) -> None:
        self.sock.close(0)
        if self._auth is not None:
            self._auth.close()
            self._auth = None


def list_objects(d: Directory, req: ListObjects, position: tuple[int, int, int],
                 scope: str = "") -> ListObjectsReply:
    """One page of ``LIST_OBJECTS``: the objects of whole shards from
    ``req.cursor`` on, until about ``req.limit`` objects (one shard at least),
    with their live replicas; every segment on the first page. Only the
    objects of the tenant whose namespace prefix is ``scope``
    (:func:`kvpool.core.tenants.scope_prefix`; "" the default tenant: keys
    under no namespace), their keys as that tenant names them."""
    shards = d.objects.shards
    cursor = req.cursor
    if not 0 <= cursor < len(shards):
        raise KVPoolError(f"cursor {cursor} out of range [0, {len(shards)})",
                          ErrorCode.INVALID_PARAMS)
    if req.limit <= 0:
        raise KVPoolError("limit must be > 0", ErrorCode.INVALID_PARAMS)
    prefix = scope + req.prefix
    cut = len(scope)
    replicas: dict[str, Replica] = {}
    out: list[ObjectStored] = []
    i = cursor
    while i < len(shards) and len(out) < req.limit:
        for key, obj in d.objects.shard_at(i).items():
            if prefix and not key.startswith(prefix):
                continue
            if not cut and key[:1] == TENANT_SEP:  # another tenant's
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
                out.append(ObjectStored(key[cut:] if cut else key, obj.size, reps))
        i += 1
    segments: list[SegmentAdded] = []
    if cursor == 0:
        segments = [SegmentAdded(s.id, _TIERS[s.kind], s.desc.host_id, s.desc.size)
                    for s in d.segments.values()]
    stream, seq, epoch = position
    return ListObjectsReply(out, segments, i if i < len(shards) else 0, stream, seq, epoch)
