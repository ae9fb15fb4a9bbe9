"""The typed values the master's ops carry and every layer shares.

Object keys' rules (:func:`validate_key`), segment and replica descriptors,
a segment's usage as LIST_SEGMENTS reports it, placement options and SSD-tier
copy tasks. They travel inside the ops of :mod:`kvpool.core.ops` (msgspec
Structs encoded as msgpack arrays in field order: append new fields with
defaults at the end, never reorder) and are kept by the master's journal and
snapshots (:meth:`SegmentDescriptor.to_wire`), the transfer engine and the
client. :mod:`kvpool.core.protocol` re-exports every name.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "KEY_MIN",
    "MAX_KEY_LENGTH",
    "RESERVED_KEY_PREFIX",
    "Checksum",
    "PutOptions",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "SegmentDescriptor",
    "SegmentInfo",
    "SegmentKind",
    "TierTask",
    "validate_key",
]

MAX_KEY_LENGTH = 4096
#: Keys starting below U+0020 are the master's: NUL starts its reservation
#: placeholders, U+001F a tenant's namespace (kvpool.core.tenants). Every
#: user-facing op refuses them with INVALID_KEY. ``key < KEY_MIN`` is true for
#: exactly the empty key and those.
RESERVED_KEY_PREFIX = "\x00"
KEY_MIN = " "


def validate_key(key: object, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``key`` if it is a valid object key, else raise INVALID_KEY."""
    if not isinstance(key, str):
        raise KVPoolError(f"key must be str, got {type(key).__name__}", ErrorCode.INVALID_KEY)
    if key < KEY_MIN:
        raise KVPoolError("key must not be empty nor start below U+0020 (reserved)",
                          ErrorCode.INVALID_KEY)
    if len(key) > max_length:
        raise KVPoolError(f"key longer than {max_length}", ErrorCode.INVALID_KEY)
    return key


class SegmentKind(IntEnum):
    """What a segment is made of (a transport serves some kinds only)."""

    MEMORY = 0  # POSIX shared memory (/dev/shm), mappable by same-host peers
    FILE = 1  # preallocated file in a directory (SSD tier)


class ReplicaStatus(IntEnum):
    """A replica is PROCESSING from PUT_START until its PUT_END, then COMPLETE."""

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
