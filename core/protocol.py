"""The master's wire protocol: one typed schema per op, used by both ends.

Every op has a request and a reply type (msgspec Structs, encoded as
msgpack arrays in field order); :data:`OPS` maps each :class:`Op` to them and
is the op table (``docs/INTERFACES.md`` is generated from it by
:func:`op_table_markdown`). The server decodes a request straight into its
Struct, so the schema *is* the argument check: a wrong type, a missing field
or a wrong count is an ``INVALID_PARAMS`` reply (``INVALID_KEY`` when the
bad field is a key), never a crash. Checks that depend on the master's
configuration (key length, sizes, batch length) stay in the handlers.

Framing (the same bytes over ZeroMQ and over the same-host Unix socket of
:mod:`kvpool.master.local_rpc`, where each frame is prefixed with its length
as ``LOCAL_FRAME_HEADER`` bytes little-endian)::

    request  [op: int, id: int, args: <the op's request Struct>]
    reply    [id: int | nil, code: int(ErrorCode), result: <reply Struct> | nil, error: str]

``result`` is nil unless ``code`` is OK. A frame that is not such an array
gets a ``MALFORMED_FRAME`` reply with id nil, an unknown op ``UNKNOWN_OP``,
a frame above ``max_frame_size`` ``FRAME_TOO_LARGE``.

Batch ops take columns (``keys``, ``sizes``) and answer per-key ``codes`` in
input order beside per-key value columns. Replicas of put and get replies
carry an index into the reply's ``caps`` list: one capability token signed
per segment and batch (:mod:`kvpool.core.capability`), not one per key.

Adding an op: define ``XRequest(Request[XReply])`` and ``XReply(Reply)``
here, decorate the request with ``@register(Op.X, XReply, "summary")``, add
the handler ``OpHandlers.x`` in ``master/handlers.py`` (named after the op),
then run ``python -m kvpool.core.protocol`` to refresh the table in
``docs/INTERFACES.md`` (a test checks they match).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Generic, TypeVar

import msgpack
import msgspec

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.events import ObjectStored, SegmentAdded

__all__ = [
    "KEY_MIN",
    "LOCAL_FRAME_HEADER",
    "MAX_KEY_LENGTH",
    "OPS",
    "RESERVED_KEY_PREFIX",
    "BatchExist",
    "BatchExistReply",
    "BatchGetReplicaList",
    "BatchGetReplicaListReply",
    "BatchGetSize",
    "BatchGetSizeReply",
    "BatchKeysReply",
    "BatchPutCommit",
    "BatchPutEnd",
    "BatchPutRevoke",
    "BatchPutStart",
    "BatchPutStartReply",
    "BatchRemove",
    "BatchReplicaClear",
    "BatchReserveReply",
    "BatchUpsertStart",
    "Checksum",
    "CreateCopyTask",
    "CreateMoveTask",
    "Empty",
    "Exist",
    "ExistReply",
    "GetReplicaList",
    "GetReplicaListReply",
    "GetSegments",
    "GetSegmentsReply",
    "GetSize",
    "GetSizeReply",
    "ListObjects",
    "ListObjectsReply",
    "ListSegments",
    "ListSegmentsReply",
    "LocalEndpoint",
    "LocalEndpointReply",
    "MountSegment",
    "MountSegmentReply",
    "Op",
    "OpSpec",
    "Ping",
    "PingReply",
    "PutCommit",
    "PutEnd",
    "PutOptions",
    "PutRevoke",
    "PutStart",
    "PutStartReply",
    "QueryTask",
    "QueryTaskReply",
    "Remove",
    "RemoveAll",
    "RemoveAllReply",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "Reply",
    "ReplyFrame",
    "Request",
    "ReserveReply",
    "SegmentDescriptor",
    "SegmentInfo",
    "SegmentKind",
    "Stats",
    "StatsReply",
    "TaskReply",
    "TierTask",
    "TierTaskDone",
    "UnmountSegment",
    "UpsertStart",
    "decode_frame",
    "decode_reply",
    "decode_request",
    "encode_error",
    "encode_frame",
    "encode_reply",
    "encode_request",
    "op_table_markdown",
    "peek_id",
    "register",
    "validate_key",
]

MAX_KEY_LENGTH = 4096
#: Keys starting with NUL are the master's (reservation placeholders); every
#: user-facing op refuses them with INVALID_KEY. ``key < KEY_MIN`` is true for
#: exactly the empty key and the reserved ones.
RESERVED_KEY_PREFIX = "\x00"
KEY_MIN = "\x01"
# Same-host Unix-socket framing (master/local_rpc.py): each payload is prefixed
# with its length as this many bytes, little-endian.
LOCAL_FRAME_HEADER = 4

R = TypeVar("R", bound="Reply")


class Op(IntEnum):
    PING = 1
    MOUNT_SEGMENT = 2
    UNMOUNT_SEGMENT = 3
    PUT_START = 10
    PUT_END = 11
    PUT_REVOKE = 12
    GET_REPLICA_LIST = 13
    EXIST = 14
    GET_SIZE = 15
    REMOVE = 16
    REMOVE_ALL = 17
    REMOVE_BY_REGEX = 18
    UPSERT_START = 19
    PUT_COMMIT = 20
    BATCH_PUT_START = 30
    BATCH_PUT_END = 31
    BATCH_PUT_REVOKE = 32
    BATCH_GET_REPLICA_LIST = 33
    BATCH_EXIST = 34
    BATCH_GET_SIZE = 35
    BATCH_REMOVE = 36
    BATCH_UPSERT_START = 37
    BATCH_REPLICA_CLEAR = 38
    BATCH_PUT_COMMIT = 39
    STATS = 50
    LIST_SEGMENTS = 51
    GET_SEGMENTS = 52
    LOCAL_ENDPOINT = 53
    TIER_TASK_DONE = 60
    LIST_OBJECTS = 70
    CREATE_COPY_TASK = 80
    CREATE_MOVE_TASK = 81
    QUERY_TASK = 82


class SegmentKind(IntEnum):
    MEMORY = 0  # POSIX shared memory (/dev/shm), mappable by same-host peers
    FILE = 1  # preallocated file in a directory (SSD tier)


class ReplicaStatus(IntEnum):
    PROCESSING = 0
    COMPLETE = 1


#: An object's checksum as the putting client gave it (opaque to the master).
Checksum = int | str | None



class SegmentDescriptor(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a peer needs to read/write a segment.

    ``name`` is the shm name (memory) or absolute file path (file);
    ``endpoint`` the owner's transfer server address (``tcp://host:port``);
    ``base_offset`` where usable space starts inside the region (file header);
    ``extra`` transport-specific data (e.g. RDMA rkey/addr).
    """

    segment_id: str
    client_id: str
    host_id: str
    kind: SegmentKind
    size: int
    name: str
    endpoint: str = ""
    base_offset: int = 0
    extra: dict[str, Any] = {}

    def to_wire(self) -> dict[str, Any]:
        """The map form kept in the master's journal and snapshots."""
        return {"segment_id": self.segment_id, "client_id": self.client_id,
                "host_id": self.host_id, "kind": int(self.kind), "size": self.size,
                "name": self.name, "endpoint": self.endpoint, "base_offset": self.base_offset,
                "extra": dict(self.extra)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SegmentDescriptor:
        """Parse the map form; INVALID_PARAMS if a field is missing or of a wrong type."""
        try:
            return cls(segment_id=str(d["segment_id"]), client_id=str(d["client_id"]),
                       host_id=str(d["host_id"]), kind=SegmentKind(int(d["kind"])),
                       size=int(d["size"]), name=str(d["name"]),
                       endpoint=str(d.get("endpoint", "")),
                       base_offset=int(d.get("base_offset", 0)),
                       extra=dict(d.get("extra") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise KVPoolError(f"bad segment descriptor: {exc}", ErrorCode.INVALID_PARAMS) from exc


class ReplicaDescriptor(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One replica of an object: ``length`` bytes at ``offset`` of a segment.

    ``offset`` is relative to the start of the segment's usable region (the
    transfer engine adds the descriptor's ``base_offset``). ``cap`` indexes
    the reply's ``caps`` list: the capability token covering this replica
    (-1: none, capabilities are off).
    """

    segment_id: str
    offset: int
    length: int
    status: ReplicaStatus = ReplicaStatus.COMPLETE
    cap: int = -1


class SegmentInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """A segment as LIST_SEGMENTS shows it: its descriptor and its allocator's state."""

    descriptor: SegmentDescriptor
    used: int
    capacity: int
    fragmentation: float
    free_blocks: int
    objects: int
    state: str  # active | suspect | awaiting | dead ...


class TierTask(msgspec.Struct, array_like=True, omit_defaults=True):
    """An SSD-tier copy task handed to a node in a PING reply: copy ``size``
    bytes of ``key`` from ``src_id@src_off`` to ``dst_id@dst_off``. ``kind`` 1
    offload, 2 promote; ``cap`` indexes the reply's ``caps`` (WRITE on the
    destination); ``ttl_ms`` is how long the master waits for TIER_TASK_DONE."""

    id: int
    kind: int
    key: str
    size: int
    src_id: str
    src_off: int
    dst_id: str
    dst_off: int
    ttl_ms: int = 0
    cap: int = -1


class PutOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Placement of one put (or of every key of a batch put).

    ``soft_pin``: evicted after unpinned objects for ``soft_pin_ttl_ms`` from
    the commit (-1: the master's ``soft_pin_ttl_ms``; 0: not pinned; above
    ``max_soft_pin_ttl_ms``: INVALID_PARAMS). An upsert keeps the replaced
    object's soft pin unless it pins anew or ``soft_unpin``."""

    replica_num: int = 1
    disk_replica_num: int = 0
    preferred_segments: list[str] = []
    hard_pin: bool = False
    soft_pin: bool = False
    soft_pin_ttl_ms: int = -1
    soft_unpin: bool = False


# ------------------------------------------------------------------ base types


class Request(msgspec.Struct, Generic[R], array_like=True, omit_defaults=True, gc=False):
    """Base of every request. ``OP`` is set by :func:`register`."""

    OP: ClassVar[Op]


class Reply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every reply."""


class Empty(Reply):
    """The reply of ops that return nothing but their code."""


@dataclass(frozen=True)
class OpSpec:
    """One row of the op table."""

    op: Op
    request: type[Request[Any]]
    reply: type[Reply]
    summary: str
    request_decoder: msgspec.msgpack.Decoder[Any]
    reply_decoder: msgspec.msgpack.Decoder[Any]

    @property
    def handler_name(self) -> str:
        """The method of ``master.handlers.OpHandlers`` that serves this op."""
        return self.op.name.lower()


#: The op table: Op -> request type, reply type, summary.
OPS: dict[Op, OpSpec] = {}
_T = TypeVar("_T", bound=type[Request[Any]])


def register(op: Op, reply: type[Reply], summary: str) -> Any:
    """Class decorator: make the decorated request type ``op``'s request."""

    def deco(cls: _T) -> _T:
        if op in OPS:
            raise ValueError(f"{op.name} registered twice")
        cls.OP = op
        OPS[op] = OpSpec(op, cls, reply, summary, msgspec.msgpack.Decoder(cls),
                         msgspec.msgpack.Decoder(reply))
        return cls

    return deco


# ------------------------------------------------------------------ ops

class PingReply(Reply):
    remount: bool
    segment_ids: list[str] = []
    tasks: list[TierTask] = []
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []
    known: bool = False  # heartbeat replies: the master knows this client
    #: the leader epoch of the replying master (0: no HA); the segment owner's
    #: capability verifier raises its epoch high-water to it (fencing)
    epoch: int = 0


@register(Op.PING, PingReply, "liveness; remount=true when the master does not know the "
          "client (e.g. restarted without its segments); may carry SSD-tier copy tasks; "
          "epoch: the replying leader's term (0 without HA), raises the owner's capability "
          "epoch high-water; heartbeat=true (the client's guard process): its memory lives, "
          "the process may be stalled -- keeps a suspect client from being dropped, never "
          "hands out tasks")
class Ping(Request[PingReply]):
    client_id: str
    heartbeat: bool = False


class MountSegmentReply(Reply):
    capability_key: bytes = b""  # the segment's signing key (empty: capabilities off)


@register(Op.MOUNT_SEGMENT, MountSegmentReply,
          "mount a segment (SEGMENT_ALREADY_EXISTS if mounted and active; one awaiting its "
          "owner after a restart, or suspect, is re-adopted with its objects when the mount "
          "names the same memory)")
class MountSegment(Request[MountSegmentReply]):
    client_id: str
    segment: SegmentDescriptor


@register(Op.UNMOUNT_SEGMENT, Empty, "unmount one of the caller's segments")
class UnmountSegment(Request[Empty]):
    client_id: str
    segment_id: str


class PutStartReply(Reply):
    replicas: list[ReplicaDescriptor]
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []


@register(Op.PUT_START, PutStartReply,
          "allocate every replica of a new object (PROCESSING until PUT_END)")
class PutStart(Request[PutStartReply]):
    client_id: str
    key: str
    size: int
    options: PutOptions | None = None
    checksum: Checksum = None
    group: str | None = None  # object group ("" none; an existing object's cannot change)


@register(Op.UPSERT_START, PutStartReply,
          "PUT_START that may replace: an existing object stays readable, unchanged, until "
          "PUT_END swaps the new one in (its old space is freed after its read lease); an "
          "in-flight put of the key is preempted; the hard pin carries over")
class UpsertStart(PutStart):
    pass


class ReserveReply(Reply):
    """A commit's reply; with ``placeholder`` set, an anonymous reservation
    for the caller's next put of the size it asked: a pending put under that
    placeholder key (``replicas`` to write, their ``caps``), to be named by
    PUT_COMMIT. ``ttl_ms``: how long from this reply the caller may still
    start its write into it. Empty ``placeholder``: none was made."""

    placeholder: str = ""
    replicas: list[ReplicaDescriptor] = []
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []
    ttl_ms: int = 0


@register(Op.PUT_END, ReserveReply,
          "mark the caller's pending put complete; reserve > 0: then reserve that many bytes "
          "(one memory replica) for the caller's next put (ReserveReply; none made: the put "
          "is still OK)")
class PutEnd(Request[ReserveReply]):
    client_id: str
    key: str
    reserve: int = 0


@register(Op.PUT_COMMIT, ReserveReply,
          "the caller's reservation (placeholder of a ReserveReply) becomes the pending put "
          "of key and is committed as PUT_END commits (OBJECT_NOT_FOUND: no such reservation "
          "of the caller; OBJECT_ALREADY_EXISTS: key stored or in flight, the reservation "
          "stays); reserve > 0: a new reservation as PUT_END's")
class PutCommit(Request[ReserveReply]):
    client_id: str
    placeholder: str
    key: str
    reserve: int = 0


@register(Op.PUT_REVOKE, Empty, "drop the caller's pending put and free its space")
class PutRevoke(Request[Empty]):
    client_id: str
    key: str


class GetReplicaListReply(Reply):
    size: int
    lease_ttl_ms: int
    replicas: list[ReplicaDescriptor]
    checksum: Checksum = None
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []


@register(Op.GET_REPLICA_LIST, GetReplicaListReply,
          "complete replicas of an object; grants a read lease")
class GetReplicaList(Request[GetReplicaListReply]):
    key: str


class ExistReply(Reply):
    exists: bool


@register(Op.EXIST, ExistReply, "whether an object is complete; grants a lease when it is")
class Exist(Request[ExistReply]):
    key: str


class GetSizeReply(Reply):
    size: int


@register(Op.GET_SIZE, GetSizeReply, "an object's size")
class GetSize(Request[GetSizeReply]):
    key: str


@register(Op.REMOVE, Empty, "remove an object (OBJECT_HAS_LEASE unless force)")
class Remove(Request[Empty]):
    key: str
    force: bool = False


class RemoveAllReply(Reply):
    removed: int


@register(Op.REMOVE_ALL, RemoveAllReply, "remove every unleased object (every with force)")
class RemoveAll(Request[RemoveAllReply]):
    force: bool = False


@register(Op.REMOVE_BY_REGEX, RemoveAllReply,
          "remove every unleased object (every with force) whose key starts with prefix and, "
          "with prefix stripped, matches pattern (re.search; '' matches all); keys starting "
          "with exclude_prefix are kept (INVALID_PARAMS for a bad pattern)")
class RemoveByRegex(Request[RemoveAllReply]):
    pattern: str
    force: bool = False
    prefix: str = ""
    exclude_prefix: str = ""


class BatchPutStartReply(Reply):
    codes: list[int]
    replicas: list[list[ReplicaDescriptor]]  # [] where the code is not OK
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []


@register(Op.BATCH_PUT_START, BatchPutStartReply,
          "PUT_START of many keys with one placement; per-key codes")
class BatchPutStart(Request[BatchPutStartReply]):
    client_id: str
    keys: list[str]
    sizes: list[int]
    options: PutOptions | None = None
    checksums: list[Checksum] | None = None
    groups: list[str] | None = None  # per key, as PUT_START's group


class BatchKeysReply(Reply):
    codes: list[int]


@register(Op.BATCH_UPSERT_START, BatchPutStartReply,
          "UPSERT_START of many keys with one placement; per-key codes")
class BatchUpsertStart(BatchPutStart):
    pass


class BatchReserveReply(BatchKeysReply):
    """A batch commit's reply: per-key ``codes``; with ``placeholders``, the
    reservations asked for (as ReserveReply's, one pending put each:
    ``replicas[i]`` of ``placeholders[i]``, their ``caps``), fewer than asked
    or none when the pool could not place them (the commit is OK regardless)."""

    placeholders: list[str] = []
    replicas: list[ReplicaDescriptor] = []
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []
    ttl_ms: int = 0


@register(Op.BATCH_PUT_END, BatchReserveReply,
          "PUT_END of many keys; per-key codes; reserve > 0: then up to reserve_count (at most "
          "as many as keys) reservations of reserve bytes each (one memory replica) for the "
          "caller's next puts")
class BatchPutEnd(Request[BatchReserveReply]):
    client_id: str
    keys: list[str]
    reserve: int = 0
    reserve_count: int = 0


@register(Op.BATCH_PUT_COMMIT, BatchReserveReply,
          "PUT_COMMIT of many keys: placeholders[i] (the caller's reservation) becomes the "
          "pending put of keys[i], committed as PUT_END; per-key codes as PUT_COMMIT's; "
          "reserve > 0: new reservations as BATCH_PUT_END's")
class BatchPutCommit(Request[BatchReserveReply]):
    client_id: str
    placeholders: list[str]
    keys: list[str]
    reserve: int = 0
    reserve_count: int = 0


@register(Op.BATCH_PUT_REVOKE, BatchKeysReply, "PUT_REVOKE of many keys; per-key codes")
class BatchPutRevoke(Request[BatchKeysReply]):
    client_id: str
    keys: list[str]


class BatchGetReplicaListReply(Reply):
    codes: list[int]
    sizes: list[int]  # 0 where the code is not OK
    replicas: list[list[ReplicaDescriptor]]
    lease_ttl_ms: int
    checksums: list[Checksum] = []  # [] when no object has one
    segments: dict[str, SegmentDescriptor] = {}
    caps: list[bytes] = []


@register(Op.BATCH_GET_REPLICA_LIST, BatchGetReplicaListReply,
          "GET_REPLICA_LIST of many keys; per-key codes")
class BatchGetReplicaList(Request[BatchGetReplicaListReply]):
    keys: list[str]


class BatchExistReply(Reply):
    codes: list[int]
    exists: list[bool]


@register(Op.BATCH_EXIST, BatchExistReply, "EXIST of many keys; per-key codes")
class BatchExist(Request[BatchExistReply]):
    keys: list[str]


class BatchGetSizeReply(Reply):
    codes: list[int]
    sizes: list[int]


@register(Op.BATCH_GET_SIZE, BatchGetSizeReply, "GET_SIZE of many keys; per-key codes")
class BatchGetSize(Request[BatchGetSizeReply]):
    keys: list[str]


@register(Op.BATCH_REMOVE, BatchKeysReply, "REMOVE of many keys; per-key codes")
class BatchRemove(Request[BatchKeysReply]):
    keys: list[str]
    force: bool = False


@register(Op.BATCH_REPLICA_CLEAR, BatchKeysReply,
          "clear each key's replicas on segment_id ('' = every replica: the object goes); "
          "only the object's writer may (PERMISSION_DENIED), not while read-leased "
          "(OBJECT_HAS_LEASE); OBJECT_NOT_FOUND when it has no replica there; per-key codes")
class BatchReplicaClear(Request[BatchKeysReply]):
    client_id: str
    keys: list[str]
    segment_id: str = ""


class StatsReply(Reply):
    """The master's counters. ``tiering`` holds the SSD tier's counters;
    ``extra`` directory counters that have no field here yet."""

    objects: int
    pending: int
    segments: int
    clients: int
    memory_used: int
    memory_capacity: int
    file_used: int
    file_capacity: int
    bytes_used: int
    bytes_capacity: int
    evictions: int
    evicted_bytes: int
    lease_refusals: int
    preemptions: int
    expired_clients: int
    uptime_s: float
    version: str
    pid: int
    loadavg: float
    curve: bool
    curve_denied: int
    capabilities: bool
    capabilities_granted: int
    too_many_requests: int
    snapshots: int
    snapshot_in_progress: bool
    last_snapshot_pause_ms: float
    last_snapshot_pause_cpu_ms: float
    max_snapshot_step_ms: float
    max_snapshot_step_cpu_ms: float
    last_snapshot_duration_s: float
    restored_objects: int
    max_loop_ms: float
    journal_seq: int | None
    local_rpc_requests: int
    local_rpc_connections: int
    tiering: dict[str, int] = {}
    extra: dict[str, Any] = {}
    # liveness (docs/INTERFACES.md): clients and segments suspect now, and the
    # times a client became suspect / came back with its segments
    suspect_clients: int = 0
    suspect_segments: int = 0
    suspected_clients: int = 0
    revived_clients: int = 0
    # SSD tier: puts placed on disk because memory was full; abandoned puts whose
    # space is held until their writer's WRITE capability has ended
    spilled: int = 0
    held_puts: int = 0
    # upserts that replaced an object; objects soft-pinned now (with a deadline)
    replaced: int = 0
    soft_pinned: int = 0
    groups: int = 0  # object groups with members now

    def as_dict(self) -> dict[str, Any]:
        """Every counter in one flat map (tiering and extra merged in)."""
        out = msgspec.structs.asdict(self)
        out.update(out.pop("tiering"))
        out.update(out.pop("extra"))
        return out


@register(Op.STATS, StatsReply, "the master's counters")
class Stats(Request[StatsReply]):
    pass


class ListSegmentsReply(Reply):
    segments: list[SegmentInfo]


@register(Op.LIST_SEGMENTS, ListSegmentsReply, "every segment with its usage")
class ListSegments(Request[ListSegmentsReply]):
    pass


class GetSegmentsReply(Reply):
    segments: dict[str, SegmentDescriptor]


@register(Op.GET_SEGMENTS, GetSegmentsReply, "descriptors of the active segments among the ids")
class GetSegments(Request[GetSegmentsReply]):
    segment_ids: list[str]


class LocalEndpointReply(Reply):
    path: str = ""  # empty: the master has no same-host socket
    instance: str = ""
    tcp_port: int = 0  # the direct RPC port on the master's host (0: none)


@register(Op.LOCAL_ENDPOINT, LocalEndpointReply,
          "the master's direct RPC sockets (same-host Unix path, TCP port) and instance id")
class LocalEndpoint(Request[LocalEndpointReply]):
    pass


@register(Op.TIER_TASK_DONE, Empty,
          "a node reports a tier copy task (OBJECT_NOT_FOUND for an unknown or expired task)")
class TierTaskDone(Request[Empty]):
    client_id: str
    task_id: int
    ok: bool
    error: str = ""


class ListObjectsReply(Reply):
    """One page of the directory: complete objects with their replicas, as
    the events describe them (:mod:`kvpool.core.events`). ``segments``: every
    segment, on the first page only. ``next_cursor``: 0 when this was the
    last page. ``stream``/``seq``/``epoch``: the event stream's position when
    the page was taken (0 when events are off); a subscriber applies the
    batches after the first page's ``seq``."""

    objects: list[ObjectStored]
    segments: list[SegmentAdded]
    next_cursor: int
    stream: int
    seq: int
    epoch: int


@register(Op.LIST_OBJECTS, ListObjectsReply,
          "a page of complete objects with their replicas (whole directory shards, about "
          "limit objects; keys starting with prefix); cursor 0 starts, next_cursor 0 ends; "
          "the resync of an events subscriber")
class ListObjects(Request[ListObjectsReply]):
    cursor: int = 0
    limit: int = 4096
    prefix: str = ""


class TaskReply(Reply):
    task_id: int


@register(Op.CREATE_COPY_TASK, TaskReply,
          "copy an object's replica onto each target segment (executed by a replica "
          "owner); OBJECT_NOT_FOUND, INVALID_PARAMS (no or unknown target), "
          "NO_AVAILABLE_HANDLE (no room), OBJECT_HAS_REPLICATION_TASK; targets that hold "
          "a replica are skipped")
class CreateCopyTask(Request[TaskReply]):
    key: str
    targets: list[str]


@register(Op.CREATE_MOVE_TASK, TaskReply,
          "move an object's replica from source to target (the source replica is freed "
          "after the copy); errors as CREATE_COPY_TASK, INVALID_PARAMS also for a source "
          "without a replica or equal to the target")
class CreateMoveTask(Request[TaskReply]):
    key: str
    source: str
    target: str


class QueryTaskReply(Reply):
    """A copy/move task: ``status`` 0 pending, 1 processing, 2 failed, 3 success
    (Mooncake's TaskStatus); times in epoch ms; ``executor`` the client copying."""

    task_id: int
    move: bool
    key: str
    status: int
    created_ms: int
    updated_ms: int
    executor: str
    message: str = ""


@register(Op.QUERY_TASK, QueryTaskReply,
          "the state of a copy/move task (TASK_NOT_FOUND: unknown, or forgotten after "
          "100000 newer tasks)")
class QueryTask(Request[QueryTaskReply]):
    task_id: int


# ------------------------------------------------------------------ framing


class RequestFrame(msgspec.Struct, array_like=True, gc=False):
    op: int
    id: int
    args: msgspec.Raw


class ReplyFrame(msgspec.Struct, array_like=True, gc=False):
    """A decoded reply envelope; ``result`` is still encoded (decode it with
    the op's reply type)."""

    id: int | None
    code: int
    result: msgspec.Raw
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_request_frame = msgspec.msgpack.Decoder(RequestFrame).decode
_reply_frame = msgspec.msgpack.Decoder(ReplyFrame).decode
_FIELD_AT = re.compile(r"at `\$\[(\d+)\]")
_KEY_FIELDS = frozenset({"key", "keys"})


def encode_request(rid: int, req: Request[Any]) -> bytes:
    """The request frame for ``req`` (its op from the op table)."""
    return _encode((req.OP, rid, req))


def encode_reply(rid: int, result: Reply) -> bytes:
    """A successful reply frame."""
    return _encode((rid, 0, result, ""))


def encode_error(rid: int | None, code: ErrorCode | int, message: str) -> bytes:
    """An error reply frame."""
    return _encode((rid, int(code), None, message))


def _bad_frame(payload: bytes | memoryview, exc: Exception) -> KVPoolError:
    return KVPoolError(f"malformed frame: {exc}", ErrorCode.MALFORMED_FRAME)


def peek_id(payload: bytes | memoryview) -> int | None:
    """The request id of a frame that failed to decode whole (None if unreadable)."""
    try:
        return _request_frame(payload).id
    except Exception:
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception:
            return None
        if isinstance(obj, list | tuple) and len(obj) >= 2 and type(obj[1]) is int:
            return int(obj[1])
        return None


def decode_request(payload: bytes | memoryview,
                   max_size: int | None = None) -> tuple[int, OpSpec, Request[Any]]:
    """``(id, spec, request)`` of a request frame.

    Raises KVPoolError: FRAME_TOO_LARGE, MALFORMED_FRAME (not a request
    frame), UNKNOWN_OP, INVALID_KEY (a key field of a wrong type) or
    INVALID_PARAMS (any other field). The id is in ``exc.request_id`` when
    it could be read.
    """
    if max_size is not None and len(payload) > max_size:
        err = KVPoolError(f"frame of {len(payload)} bytes exceeds {max_size}",
                          ErrorCode.FRAME_TOO_LARGE)
        err.request_id = peek_id(payload)  # type: ignore[attr-defined]
        raise err
    try:
        frame = _request_frame(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        err = _bad_frame(payload, exc)
        err.request_id = None  # type: ignore[attr-defined]
        raise err from None
    spec = OPS.get(frame.op)  # type: ignore[call-overload]
    if spec is None:
        err = KVPoolError(f"unknown op {frame.op}", ErrorCode.UNKNOWN_OP)
        err.request_id = frame.id  # type: ignore[attr-defined]
        raise err
    try:
        req = spec.request_decoder.decode(frame.args)
    except msgspec.ValidationError as exc:
        err = KVPoolError(str(exc), _validation_code(spec.request, str(exc)))
        err.request_id = frame.id  # type: ignore[attr-defined]
        raise err from None
    except msgspec.DecodeError as exc:
        err = _bad_frame(payload, exc)
        err.request_id = frame.id  # type: ignore[attr-defined]
        raise err from None
    return frame.id, spec, req


def _validation_code(cls: type[msgspec.Struct], message: str) -> ErrorCode:
    """INVALID_KEY when the field that failed is a key (``key``/``keys``)."""
    m = _FIELD_AT.search(message)
    if m is not None:
        i = int(m.group(1))
        fields = cls.__struct_fields__
        if i < len(fields) and fields[i] in _KEY_FIELDS:
            return ErrorCode.INVALID_KEY
    return ErrorCode.INVALID_PARAMS


def decode_reply(payload: bytes | memoryview) -> ReplyFrame:
    """The reply envelope (MALFORMED_FRAME if it is not one)."""
    try:
        return _reply_frame(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVPoolError(f"malformed reply: {exc}", ErrorCode.MALFORMED_FRAME) from None


def validate_key(key: object, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``key`` if it is a valid object key, else raise INVALID_KEY."""
    if not isinstance(key, str):
        raise KVPoolError(f"key must be str, got {type(key).__name__}", ErrorCode.INVALID_KEY)
    if key < KEY_MIN:
        raise KVPoolError("key must not be empty nor start with NUL (reserved)",
                          ErrorCode.INVALID_KEY)
    if len(key) > max_length:
        raise KVPoolError(f"key longer than {max_length}", ErrorCode.INVALID_KEY)
    return key


# Untyped msgpack frames, for the transfer server's headers (their own schema).
def encode_frame(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_frame(data: bytes | memoryview, max_size: int | None = None) -> Any:
    """Decode one msgpack frame; raise MALFORMED_FRAME on anything invalid."""
    if max_size is not None and len(data) > max_size:
        raise KVPoolError(
            f"frame of {len(data)} bytes exceeds {max_size}", ErrorCode.FRAME_TOO_LARGE
        )
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types on garbage input
        raise KVPoolError(f"malformed frame: {exc}", ErrorCode.MALFORMED_FRAME) from exc


# ------------------------------------------------------------------ docs


def _type_name(t: Any) -> str:
    name = getattr(t, "__name__", None)
    if name is not None and not getattr(t, "__args__", None):
        return str(name)
    return str(t).replace("typing.", "").replace("kvpool.core.protocol.", "")


def _fields(cls: type[msgspec.Struct]) -> str:
    parts = []
    for f in msgspec.structs.fields(cls):
        s = f"{f.name}: {_type_name(f.type)}"
        if f.default is not msgspec.NODEFAULT:
            s += f" = {f.default!r}"
        elif f.default_factory is not msgspec.NODEFAULT:
            s += f" = {f.default_factory()!r}"
        parts.append(s)
    return ", ".join(parts).replace("|", "\\|")


def op_table_markdown() -> str:
    """The op table as markdown (docs/INTERFACES.md embeds it verbatim)."""
    lines = ["| op | code | request fields (in wire order) | reply | what |",
             "|---|---|---|---|---|"]
    for spec in sorted(OPS.values(), key=lambda s: s.op):
        lines.append(f"| {spec.op.name} | {int(spec.op)} | {_fields(spec.request)} | "
                     f"{spec.reply.__name__}({_fields(spec.reply)}) | {spec.summary} |"
                     .replace("()", ""))
    lines.append("")
    lines.append("| type | fields (in wire order) |")
    lines.append("|---|---|")
    for cls in (SegmentDescriptor, ReplicaDescriptor, PutOptions, SegmentInfo, TierTask):
        lines.append(f"| {cls.__name__} | {_fields(cls)} |")
    return "\n".join(lines)


if __name__ == "__main__":  # print the table of the imported module (not of __main__'s copy)
    from kvpool.core import protocol

    print(protocol.op_table_markdown())
