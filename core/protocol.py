"""The master's wire protocol: ops, states, descriptors and frame codec.

Transport: ZeroMQ. The master binds a ROUTER socket; clients connect a DEALER
(one request frame) or REQ socket. Each request is one msgpack frame::

    {"op": int(Op), "id": int, "args": {...}}

and each reply one msgpack frame::

    {"id": int, "code": int(ErrorCode), "result": {...} | None, "error": str?}

Batch ops take lists and answer a per-key list of ``[code, value]`` pairs in
input order under ``result["results"]``. Descriptors travel as plain dicts
(``to_wire``/``from_wire``) so msgpack needs no extension types.

Op reference (args -> result). ``client_id`` identifies the calling process
(a uuid hex string); every op that mutates on behalf of a client carries it.

- MOUNT_SEGMENT {client_id, segment: SegmentDescriptor} -> {}
  (SEGMENT_ALREADY_EXISTS if the id is mounted; a segment awaiting its owner
  after a master restart is re-adopted when the same owner mounts it again)
- UNMOUNT_SEGMENT {client_id, segment_id} -> {}
- PING {client_id} -> {remount: bool, segment_ids: [str]} (remount=true when the
  master does not know the client, e.g. after a restart without its segments)
- PING {client_id, heartbeat: true} -> {known: bool}: from the client's guard
  process (its memory is alive, the process may be stalled): keeps a suspect
  client from being dropped; never hands out tier tasks
- PUT_START {client_id, key, size, replica_num=1, preferred_segments=[],
  hard_pin=False, soft_pin=False, checksum=None, disk_replica_num=0}
  -> {replicas: [ReplicaDescriptor], segments: {segment_id: SegmentDescriptor}}
- PUT_END {client_id, key} -> {}
- PUT_REVOKE {client_id, key} -> {}
- GET_REPLICA_LIST {key} -> {size, checksum, lease_ttl_ms, replicas: [...],
  segments: {...}} (COMPLETE replicas only; grants a read lease)
- EXIST {key} -> {exists: bool} (grants a lease when it exists)
- GET_SIZE {key} -> {size}
- REMOVE {key, force=False} -> {}
- REMOVE_ALL {force=False} -> {removed: int}
- BATCH_PUT_START {client_id, items: [{key, size, ...PUT_START args}]}
- BATCH_PUT_END / BATCH_PUT_REVOKE {client_id, keys: [str]}
- BATCH_GET_REPLICA_LIST / BATCH_EXIST / BATCH_GET_SIZE {keys: [str]}
- BATCH_REMOVE {keys: [str], force=False}
  -> {results: [[code, value], ...], segments: {...}} for every batch op
- STATS {} -> {uptime_s, objects, bytes_used, bytes_capacity, segments: int, ...}
- LIST_SEGMENTS {} -> {segments: [SegmentDescriptor + {used, capacity, fragmentation}]}
- GET_SEGMENTS {segment_ids: [str]} -> {segments: {id: SegmentDescriptor}}
- LOCAL_ENDPOINT {} -> {path: str, instance: str} (the master's same-host Unix
  socket, :mod:`kvpool.master.local_rpc`; ``{}`` when it has none)
- TIER_TASK_DONE {client_id, task_id, ok, error=""} -> {} (SSD tier, issue 5: a node
  reports a copy task it got in a PING reply; OBJECT_NOT_FOUND for an unknown or
  expired task). PING replies then carry ``tasks: [{id, kind (1 offload, 2
  promote), key, size, src: [segment_id, offset], dst: [segment_id, offset]}]``
  and ``segments: {id: SegmentDescriptor}`` when the master has tasks for the node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "LOCAL_FRAME_HEADER",
    "MAX_KEY_LENGTH",
    "Op",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "SegmentDescriptor",
    "SegmentKind",
    "decode_frame",
    "encode_frame",
    "validate_key",
]

MAX_KEY_LENGTH = 4096
# Same-host Unix-socket framing (master/local_rpc.py): each payload is prefixed
# with its length as this many bytes, little-endian.
LOCAL_FRAME_HEADER = 4


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
    BATCH_PUT_START = 30
    BATCH_PUT_END = 31
    BATCH_PUT_REVOKE = 32
    BATCH_GET_REPLICA_LIST = 33
    BATCH_EXIST = 34
    BATCH_GET_SIZE = 35
    BATCH_REMOVE = 36
    STATS = 50
    LIST_SEGMENTS = 51
    GET_SEGMENTS = 52
    LOCAL_ENDPOINT = 53
    TIER_TASK_DONE = 60


class SegmentKind(IntEnum):
    MEMORY = 0  # POSIX shared memory (/dev/shm), mappable by same-host peers
    FILE = 1  # preallocated file in a directory (SSD tier)


class ReplicaStatus(IntEnum):
    PROCESSING = 0
    COMPLETE = 1


@dataclass(slots=True)
class SegmentDescriptor:
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
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = int(self.kind)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SegmentDescriptor:
        try:
            return cls(
                segment_id=str(d["segment_id"]),
                client_id=str(d["client_id"]),
                host_id=str(d["host_id"]),
                kind=SegmentKind(int(d["kind"])),
                size=int(d["size"]),
                name=str(d["name"]),
                endpoint=str(d.get("endpoint", "")),
                base_offset=int(d.get("base_offset", 0)),
                extra=dict(d.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KVPoolError(f"bad segment descriptor: {exc}", ErrorCode.INVALID_PARAMS) from exc


@dataclass(slots=True)
class ReplicaDescriptor:
    """One replica of an object: ``length`` bytes at ``offset`` of a segment.

    ``offset`` is relative to the start of the segment's usable region (the
    transfer engine adds the descriptor's ``base_offset``). ``capability`` is
    an opaque token a transfer server may require (issue 7); empty if unused.
    """

    segment_id: str
    offset: int
    length: int
    status: ReplicaStatus = ReplicaStatus.COMPLETE
    capability: bytes = b""

    def to_wire(self) -> list[Any]:
        return [self.segment_id, self.offset, self.length, int(self.status), self.capability]

    @classmethod
    def from_wire(cls, w: list[Any]) -> ReplicaDescriptor:
        return cls(str(w[0]), int(w[1]), int(w[2]), ReplicaStatus(int(w[3])), bytes(w[4] or b""))


def validate_key(key: object, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``key`` if it is a valid object key, else raise INVALID_KEY."""
    if not isinstance(key, str):
        raise KVPoolError(f"key must be str, got {type(key).__name__}", ErrorCode.INVALID_KEY)
    if not key:
        raise KVPoolError("key must not be empty", ErrorCode.INVALID_KEY)
    if len(key) > max_length:
        raise KVPoolError(f"key longer than {max_length}", ErrorCode.INVALID_KEY)
    return key


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
