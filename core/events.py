"""The master's object events: wire types, a pool view, and a subscriber.

A master started with ``--events-port P`` publishes every committed change
of its directory on a ZeroMQ PUB socket (``tcp://HOST:P``;
:mod:`kvpool.master.events` is the publisher). Each message is one frame,
its tenant's topic (:func:`topic`: ``TOPIC`` for the default tenant)
followed by an :class:`EventBatch` as a msgpack array
(:func:`encode_message` / :func:`decode_message`). A tenant's topic carries
its objects' events (keys as it names them) and every segment event.

- ``seq`` numbers the batches of one *stream* (one master process; a new
  leader is a new stream) from 1, without gaps, per topic. A batch with no events is a
  heartbeat (sent after ``HEARTBEAT_S`` without changes, and at once to a
  new subscriber): it repeats the last seq, so a subscriber that missed a
  batch learns it within a second.
- ``epoch`` is the HA term of the publishing leader (0 without HA),
  ``stream`` a random id of the publisher.

The events are the master's journal, translated: applying them in order to
the result of a listing (``LIST_OBJECTS``) gives what the directory holds
(every object that is complete, with its replicas and their tiers), exactly
as a standby that replays the journal would. Each event either replaces a
key's state (``ObjectStored``, ``ObjectRemoved``) or removes replicas
(``ReplicaRemoved``, ``SegmentRemoved``), so replaying a change the listing
already shows is harmless; that makes the resync below exact.

Resync (a new subscriber, a seq gap, a new stream or epoch): keep the SUB
socket, wait for one message (the subscription is live), page through
``LIST_OBJECTS`` from cursor 0, then apply the received batches whose seq
is greater than the first page's ``seq``. :class:`EventSubscriber` does all
of this; :class:`PoolView` is the state it maintains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvpool.core.errors import ErrorCode, KVPoolError

if TYPE_CHECKING:
    from kvpool.core.auth import CurveConfig
    from kvpool.core.rpc_client import MasterClient

__all__ = [
    "HEARTBEAT_S",
    "TOPIC",
    "Event",
    "EventBatch",
    "EventSubscriber",
    "ObjectRemoved",
    "ObjectStored",
    "PoolView",
    "Replica",
    "ReplicaRemoved",
    "SegmentAdded",
    "SegmentRemoved",
    "Tier",
    "decode_message",
    "encode_message",
    "topic",
]

log = logging.getLogger(__name__)

#: The topic of the default tenant's messages (every message's before tenants).
TOPIC = b"kvpool"
#: Starts and ends a tenant's topic (as its namespace in a stored key).
_TENANT_TOPIC_SEP = b"\x1f"
#: A heartbeat batch follows this many seconds without a change.
HEARTBEAT_S = 1.0


class Tier(StrEnum):
    """Where a replica lives: a memory segment (DRAM) or a file segment (SSD)."""

    DRAM = "dram"
    DISK = "disk"


class Replica(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One replica of an object: the segment holding it and that segment's tier."""

    segment: str
    tier: Tier


class ObjectStored(msgspec.Struct, array_like=True, gc=False, tag="stored"):
    """``key`` is complete with exactly these replicas (a new object, or its
    replica set changed: copied to disk, promoted to memory)."""

    key: str
    size: int
    replicas: list[Replica]


class ObjectRemoved(msgspec.Struct, array_like=True, gc=False, tag="removed"):
    """``key`` is gone: removed, or its last replica evicted."""

    key: str


class ReplicaRemoved(msgspec.Struct, array_like=True, gc=False, tag="replica_removed"):
    """``key``'s replica on ``segment`` is gone (evicted from that tier); its
    other replicas stay. A key left with none is gone."""

    key: str
    segment: str


class SegmentAdded(msgspec.Struct, array_like=True, gc=False, tag="segment_added"):
    """A segment was mounted (or re-adopted with its objects) on ``host``."""

    segment: str
    tier: Tier
    host: str
    size: int


class SegmentRemoved(msgspec.Struct, array_like=True, gc=False, tag="segment_removed"):
    """A segment is gone (unmounted, or its owner died): so is every replica
    on it, and every key left without a replica."""

    segment: str


Event = ObjectStored | ObjectRemoved | ReplicaRemoved | SegmentAdded | SegmentRemoved


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One message: the events of one loop turn, in commit order (none: a heartbeat)."""

    seq: int  # 1, 2, ... per stream; a heartbeat repeats the last one
    stream: int  # random id of the publisher; seq restarts at 1 with a new one
    epoch: int  # HA term of the publishing leader (0 without HA)
    ts: float  # the master's wall clock when it was sent, seconds
    events: list[Event]


_encode_into = msgspec.msgpack.Encoder().encode_into
_decode = msgspec.msgpack.Decoder(EventBatch).decode
_TOPIC_LEN = len(TOPIC)


def topic(tenant: str = "") -> bytes:
    """The topic of ``tenant``'s events (docs/tenants.md): ``TOPIC`` for the
    default tenant ("" or ``default``), ``b"\\x1f<tenant>\\x1f"`` for another
    (no topic is a prefix of another's, so a subscription gets one tenant's)."""
    if not tenant or tenant == "default":
        return TOPIC
    return _TENANT_TOPIC_SEP + tenant.encode() + _TENANT_TOPIC_SEP


def encode_message(batch: EventBatch, topic: bytes = TOPIC) -> bytes:
    """``topic`` + the batch: one frame, what the master sends."""
    buf = bytearray(topic)
    _encode_into(batch, buf, len(topic))
    return bytes(buf)


def decode_message(msg: bytes | memoryview) -> EventBatch:
    """The batch of a message of any tenant's topic (:func:`topic`);
    MALFORMED_FRAME if it is not a topic + an :class:`EventBatch`."""
    view = memoryview(msg)
    if bytes(view[:_TOPIC_LEN]) == TOPIC:
        start = _TOPIC_LEN
    elif bytes(view[:1]) == _TENANT_TOPIC_SEP and \
            (end := bytes(view[1:66]).find(_TENANT_TOPIC_SEP)) > 0:
        start = end + 2
    else:
        raise KVPoolError("not an events message", ErrorCode.MALFORMED_FRAME)
    try:
        return _decode(view[start:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVPoolError(f"malformed event batch: {exc}", ErrorCode.MALFORMED_FRAME) from None


class PoolView:
    """What the pool holds, as events and listings describe it.

    ``objects``: key -> its latest :class:`ObjectStored` (size, replicas);
    ``segments``: segment id -> :class:`SegmentAdded`. Only keys starting
    with ``prefix`` are kept. Not thread-safe (one subscriber thread).
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.objects: dict[str, ObjectStored] = {}
        self.segments: dict[str, SegmentAdded] = {}
        self._on_segment: dict[str, set[str]] = {}  # segment id -> keys with a replica there

    def __len__(self) -> int:
        return len(self.objects)

    def clear(self) -> None:
        self.objects.clear()
        self.segments.clear()
        self._on_segment.clear()

    def tiers(self, key: str) -> set[Tier]:
        """The tiers holding ``key`` (empty: not in the pool)."""
        obj = self.objects.get(key)
        return {r.tier for r in obj.replicas} if obj is not None else set()

    def _index(self, key: str, obj: ObjectStored | None, add: bool) -> None:
        if obj is None:
            return
        for r in obj.replicas:
            if add:
                self._on_segment.setdefault(r.segment, set()).add(key)
            else:
                keys = self._on_segment.get(r.segment)
                if keys is not None:
                    keys.discard(key)

    def _set(self, ev: ObjectStored) -> None:
        key = ev.key
        self._index(key, self.objects.get(key), False)
        if ev.replicas:
            self.objects[key] = ev
            self._index(key, ev, True)
        else:
            self.objects.pop(key, None)

    def apply(self, ev: Event) -> None:
        """Apply one event (idempotent for removals; stores replace)."""
        if type(ev) is ObjectStored:
            if ev.key.startswith(self.prefix):
                self._set(ev)
        elif type(ev) is ObjectRemoved:
            self._index(ev.key, self.objects.pop(ev.key, None), False)
        elif type(ev) is ReplicaRemoved:
            obj = self.objects.get(ev.key)
            if obj is not None:
                self._set(ObjectStored(obj.key, obj.size,
                                       [r for r in obj.replicas if r.segment != ev.segment]))
        elif type(ev) is SegmentAdded:
            self.segments[ev.segment] = ev
        elif type(ev) is SegmentRemoved:
            sid = ev.segment
            self.segments.pop(sid, None)
            for key in self._on_segment.pop(sid, ()):
                obj = self.objects.get(key)
                if obj is not None:
                    self._set(ObjectStored(key, obj.size,
                                           [r for r in obj.replicas if r.segment != sid]))

    def apply_all(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.apply(ev)


class EventSubscriber:
    """Follow one master's events and keep a :class:`PoolView` exact.

    ``endpoints``: the master's events address(es), ``tcp://HOST:PORT`` (an
    HA group: every instance's; only the leader publishes). ``master``: a
    :class:`~kvpool.core.rpc_client.MasterClient` for the listing.
    ``curve``: the client's CURVE settings when the master has CURVE on.
    ``page_size``: objects per listing page; ``rcvhwm``: messages queued in
    this process at most (0: no bound). ``tenant``: whose objects to follow
    (its topic and its listing; "" the default tenant; docs/tenants.md).

    ``poll(timeout_s)`` applies what arrived and returns the events applied
    since the last call (a resync returns none: read ``view``);
    ``resyncs`` counts the listings taken (the first one included).
    """

    def __init__(self, endpoints: str | Sequence[str], master: MasterClient,
                 prefix: str = "", curve: CurveConfig | None = None,
                 page_size: int = 4096, rcvhwm: int = 0,
                 context: zmq.Context[Any] | None = None, tenant: str = "") -> None:
        from kvpool.core.protocol import ListObjects  # the op lives with the protocol

        self._list_req = ListObjects
        self.master = master
        self.tenant = tenant
        self.view = PoolView(prefix)
        self.page_size = page_size
        self.resyncs = 0
        self.batches = 0
        self.stream = 0
        self.epoch = 0
        self.seq = 0  # the last seq applied (or listed)
        self._synced = False
        self._ctx = context or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        # 0: buffer whatever arrives while listing (a bound makes a stalled
        # subscriber miss messages, then resync, instead of growing)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        for ep in [endpoints] if isinstance(endpoints, str) else list(endpoints):
            if curve is not None:
                host = ep.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
                curve.setup_client(self.sock, host)
            self.sock.connect(ep)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic(tenant))

    # ---------------------------------------------------------------- receiving
    def _recv(self, timeout_s: float) -> EventBatch | None:
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        msg = self.sock.recv(copy=False)
        try:
            return decode_message(msg.buffer)
        except KVPoolError as exc:
            log.warning("ignoring an events message: %s", exc)
            return None

    def _in_order(self, batch: EventBatch) -> bool:
        """Whether ``batch`` continues what was applied (same stream and epoch,
        seq + 1; a heartbeat repeats seq)."""
        if batch.stream != self.stream or batch.epoch != self.epoch:
            return False
        return batch.seq == (self.seq + 1 if batch.events else self.seq)

    def sync(self, timeout_s: float = 10.0, first: EventBatch | None = None) -> None:
        """Rebuild the view: one message (the subscription is live; the master
        greets a new subscriber at once), the listing, then the batches
        received meanwhile. RPC_TIMEOUT if no message arrives in ``timeout_s``;
        listing errors propagate (MasterRPCError). ``first``: a message
        already received that starts the new view (e.g. of a new stream)."""
        deadline = time.monotonic() + timeout_s
        if first is None:
            first = self._recv(timeout_s)
        while first is None:
            if time.monotonic() >= deadline:
                raise KVPoolError(f"no events message within {timeout_s}s (is --events-port "
                                  "set, and is this master the leader?)", ErrorCode.RPC_TIMEOUT)
            first = self._recv(deadline - time.monotonic())
        buffered = [first]
        view = self.view
        view.clear()
        cursor = 0
        list_seq = 0
        while True:
            page = self.master.call(self._list_req(cursor, self.page_size, view.prefix,
                                                   self.tenant))
            if not cursor:
                list_seq = page.seq
                self.stream, self.epoch = page.stream, page.epoch
                view.apply_all(page.segments)
            elif (page.stream, page.epoch) != (self.stream, self.epoch):
                view.clear()  # another master answered mid-listing: start over
                cursor = 0
                continue
            view.apply_all(page.objects)
            cursor = page.next_cursor
            if not cursor:
                break
        while (got := self._recv(0)) is not None:
            buffered.append(got)
        self.seq = list_seq
        self.resyncs += 1
        self._synced = True
        for batch in buffered:
            if batch.stream != self.stream or batch.epoch != self.epoch:
                self._synced = False  # another leader or publisher restart meanwhile
                return
            if batch.seq <= self.seq:
                continue  # already in the listing
            if not self._in_order(batch):
                self._synced = False  # lost a batch while listing
                return
            view.apply_all(batch.events)
            self.seq = batch.seq
            self.batches += 1

    def poll(self, timeout_s: float = 0.0) -> list[Event]:
        """Wait up to ``timeout_s`` for events, apply them and whatever else
        has arrived (resyncing on a gap, a new stream or epoch); return the
        events applied, in order (none after a timeout or a resync)."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._synced:
                self.sync()
                continue
            # wait for the first events; then take only what is already here
            batch = self._recv(0.0 if out else max(0.0, deadline - time.monotonic()))
            if batch is None:
                return out
            if not self._in_order(batch):
                log.info("events: resync (stream %d epoch %d seq %d after stream %d epoch %d "
                         "seq %d)", batch.stream, batch.epoch, batch.seq, self.stream,
                         self.epoch, self.seq)
                self._synced = False
                self.sync(first=batch)
                continue
            if batch.events:
                self.view.apply_all(batch.events)
                out.extend(batch.events)
                self.seq = batch.seq
                self.batches += 1

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
