"""The master's ops: one request and one reply Struct per op.

Each request type is a :class:`~kvpool.core.codec.Request` parametrised with
its reply type and entered into the op table (:data:`kvpool.core.codec.OPS`)
by :func:`~kvpool.core.codec.register` with a one-line summary;
``docs/INTERFACES.md`` shows the table as ``python -m kvpool.core.protocol``
prints it. Fields are positional on the wire (msgpack arrays in field order):
append new fields with defaults at the end of a Struct, never reorder.
:mod:`kvpool.core.protocol` re-exports every name.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool.core.codec import Empty, Op, Reply, Request, register
from kvpool.core.descriptors import (
    Checksum,
    PutOptions,
    ReplicaDescriptor,
    SegmentDescriptor,
    SegmentInfo,
    TierTask,
)
from kvpool.core.events import ObjectStored, SegmentAdded

#: A request's ``tenant`` field: the tenant it acts for (docs/tenants.md).
#: Empty is the ``default`` tenant, so a request of an older client (which
#: has no such field) acts for ``default`` as it always did. Every op that
#: names, lists, counts or removes objects carries it, as its last field.
TENANT_FIELD_DEFAULT = ""

__all__ = [
    "PING_MAX_WAIT_S",
    "TENANT_FIELD_DEFAULT",
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
    "CreateCopyTask",
    "CreateMoveTask",
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
    "Ping",
    "PingReply",
    "PutCommit",
    "PutEnd",
    "PutRevoke",
    "PutStart",
    "PutStartReply",
    "QueryTask",
    "QueryTaskReply",
    "Remove",
    "RemoveAll",
    "RemoveAllReply",
    "RemoveByRegex",
    "ReserveReply",
    "Stats",
    "StatsReply",
    "TaskReply",
    "TenantList",
    "TenantListReply",
    "TenantRow",
    "TenantSet",
    "TierTaskDone",
    "UnmountSegment",
    "UpsertStart",
]


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
          "hands out tasks; wait_ms > 0 (a node running tier tasks): when there is nothing "
          "to hand, the master may hold the request up to that long and answer it as soon as "
          "a task for the node is queued (a long poll; a master that does not hold it answers "
          "at once)")
class Ping(Request[PingReply]):
    client_id: str
    heartbeat: bool = False
    wait_ms: int = 0


#: the longest a master holds a PING, whatever its ``wait_ms`` asks
#: (kvpool.master.parked; a node asks no more)
PING_MAX_WAIT_S = 5.0


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
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.PUT_COMMIT, ReserveReply,
          "the caller's reservation (placeholder of a ReserveReply) becomes the pending put "
          "of key and is committed as PUT_END commits (OBJECT_NOT_FOUND: no such reservation "
          "of the caller; OBJECT_ALREADY_EXISTS: key stored or in flight, the reservation "
          "stays; QUOTA_EXCEEDED: the tenant is at its quota as at PUT_START, the reservation "
          "released); reserve > 0: a new reservation as PUT_END's")
class PutCommit(Request[ReserveReply]):
    client_id: str
    placeholder: str
    key: str
    reserve: int = 0
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.PUT_REVOKE, Empty, "drop the caller's pending put and free its space")
class PutRevoke(Request[Empty]):
    client_id: str
    key: str
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


class ExistReply(Reply):
    exists: bool


@register(Op.EXIST, ExistReply, "whether an object is complete; grants a lease when it is")
class Exist(Request[ExistReply]):
    key: str
    tenant: str = TENANT_FIELD_DEFAULT


class GetSizeReply(Reply):
    size: int


@register(Op.GET_SIZE, GetSizeReply, "an object's size")
class GetSize(Request[GetSizeReply]):
    key: str
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.REMOVE, Empty, "remove an object (OBJECT_HAS_LEASE unless force; a forced "
          "removal of a leased object holds its space until the lease ends)")
class Remove(Request[Empty]):
    key: str
    force: bool = False
    tenant: str = TENANT_FIELD_DEFAULT


class RemoveAllReply(Reply):
    removed: int


@register(Op.REMOVE_ALL, RemoveAllReply, "remove every unleased object (every with force)")
class RemoveAll(Request[RemoveAllReply]):
    force: bool = False
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.REMOVE_BY_REGEX, RemoveAllReply,
          "remove every unleased object (every with force) whose key starts with prefix and, "
          "with prefix stripped, matches pattern (re.search; '' matches all); keys starting "
          "with exclude_prefix are kept (INVALID_PARAMS for a bad pattern)")
class RemoveByRegex(Request[RemoveAllReply]):
    pattern: str
    force: bool = False
    prefix: str = ""
    exclude_prefix: str = ""
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.BATCH_PUT_REVOKE, BatchKeysReply, "PUT_REVOKE of many keys; per-key codes")
class BatchPutRevoke(Request[BatchKeysReply]):
    client_id: str
    keys: list[str]
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


class BatchExistReply(Reply):
    codes: list[int]
    exists: list[bool]


@register(Op.BATCH_EXIST, BatchExistReply, "EXIST of many keys; per-key codes")
class BatchExist(Request[BatchExistReply]):
    keys: list[str]
    tenant: str = TENANT_FIELD_DEFAULT


class BatchGetSizeReply(Reply):
    codes: list[int]
    sizes: list[int]


@register(Op.BATCH_GET_SIZE, BatchGetSizeReply, "GET_SIZE of many keys; per-key codes")
class BatchGetSize(Request[BatchGetSizeReply]):
    keys: list[str]
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.BATCH_REMOVE, BatchKeysReply, "REMOVE of many keys; per-key codes")
class BatchRemove(Request[BatchKeysReply]):
    keys: list[str]
    force: bool = False
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.BATCH_REPLICA_CLEAR, BatchKeysReply,
          "clear each key's replicas on segment_id ('' = every replica: the object goes); "
          "only the object's writer may (PERMISSION_DENIED), not while read-leased "
          "(OBJECT_HAS_LEASE); OBJECT_NOT_FOUND when it has no replica there; per-key codes")
class BatchReplicaClear(Request[BatchKeysReply]):
    client_id: str
    keys: list[str]
    segment_id: str = ""
    tenant: str = TENANT_FIELD_DEFAULT


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
    # SSD tier: puts placed on disk because memory was full; abandoned puts and
    # removed objects whose space is held until their writer's WRITE capability
    # or their readers' leases have ended
    spilled: int = 0
    held_puts: int = 0
    # upserts that replaced an object; objects soft-pinned now (with a deadline)
    replaced: int = 0
    soft_pinned: int = 0
    groups: int = 0  # object groups with members now
    held_bytes: int = 0  # the space held_puts hold (every replica counted)
    # a restart serves before its snapshot's objects are all made: those left
    # to make, and how long the restore took before serving began
    restore_unloaded: int = 0
    restore_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every counter in one flat map (tiering and extra merged in)."""
        out = msgspec.structs.asdict(self)
        out.update(out.pop("tiering"))
        out.update(out.pop("extra"))
        return out


@register(Op.STATS, StatsReply, "the master's counters")
class Stats(Request[StatsReply]):
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


@register(Op.CREATE_MOVE_TASK, TaskReply,
          "move an object's replica from source to target (the source replica is freed "
          "after the copy); errors as CREATE_COPY_TASK, INVALID_PARAMS also for a source "
          "without a replica or equal to the target")
class CreateMoveTask(Request[TaskReply]):
    key: str
    source: str
    target: str
    tenant: str = TENANT_FIELD_DEFAULT


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
    tenant: str = TENANT_FIELD_DEFAULT


class TenantRow(msgspec.Struct, array_like=True, gc=False):
    """One tenant as the master counts it (docs/tenants.md): quotas in
    bytes (-1: unlimited / no guaranteed share); bytes used, -1 where not
    counted (the ``default`` tenant unless the master's ``tenants:`` lists
    it); objects; hits and misses of replica lists and exists; objects
    evicted; puts refused with QUOTA_EXCEEDED."""

    name: str
    memory_quota: int
    disk_quota: int
    guaranteed: int
    memory_used: int
    disk_used: int
    objects: int
    hits: int
    misses: int
    evictions: int
    refusals: int


class TenantListReply(Reply):
    tenants: list[TenantRow]


@register(Op.TENANT_SET, TenantListReply,
          "set a tenant's quotas live (bytes; -1 = unlimited / no guaranteed share); "
          "journaled and replicated; the reply is the tenant's row; INVALID_PARAMS for a "
          "bad name or a limit below -1")
class TenantSet(Request[TenantListReply]):
    name: str
    memory: int = -1
    disk: int = -1
    guaranteed: int = -1


@register(Op.TENANT_LIST, TenantListReply,
          "every tenant known to the master: quotas, usage, objects and counters")
class TenantList(Request[TenantListReply]):
    pass
