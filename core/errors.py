"""Error codes shared by master, transfer engine and clients.

Names and numbers follow Mooncake's ``ErrorCode`` where one exists, so code
written against Mooncake's integer return codes keeps working.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ErrorCode", "KVPoolError"]


class ErrorCode(IntEnum):
    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -11
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708  # a copy/move (or tier) task is running on the object
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    # kvpool-specific codes (no Mooncake equivalent) live below -1000.
    UNKNOWN_OP = -1001
    MALFORMED_FRAME = -1002
    TRANSPORT_UNAVAILABLE = -1003
    PERMISSION_DENIED = -1004
    OUT_OF_BOUNDS = -1005
    TOO_MANY_REQUESTS = -1006
    FRAME_TOO_LARGE = -1007
    CONFIG_ERROR = -1008
    TIMEOUT = -1009
    SEGMENT_MISMATCH = -1010
    CLOSED = -1011
    NOT_SUPPORTED = -1012  # Mooncake's number: the operation has no equivalent here
    TASK_NOT_FOUND = -1400  # Mooncake's number: unknown or pruned copy/move task
    # a tenant at its quota with nothing of its own left to evict (docs/tenants.md);
    # the Mooncake class reports it as NO_AVAILABLE_HANDLE, as Mooncake does
    QUOTA_EXCEEDED = -1200
    # high availability (kvpool.core.etcd, kvpool.master.ha)
    NOT_LEADER = -1100  # this master instance is a follower: ask the leader
    STALE_EPOCH = -1101  # a request, record or capability of an older leader term
    COORDINATION_UNAVAILABLE = -1102  # etcd unreachable: writes refused until it returns
    NO_LEADER = -1103  # no instance of the group leads right now
    # a write applied at the leader but never acknowledged (not replicated, and
    # the leader is fenced or has no standby in sync): it may or may not survive
    # a failover; retryable exactly like RPC_TIMEOUT
    WRITE_OUTCOME_UNKNOWN = -1104
    # the leader has fewer in-sync standbys than sync_standbys: the write was
    # refused before it was applied (nothing changed); writes resume by
    # themselves once a standby is back in sync. Not resent by group clients.
    NOT_ENOUGH_STANDBYS = -1105


class KVPoolError(Exception):
    """Base of every kvpool exception: carries an :class:`ErrorCode`."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str = "", code: ErrorCode | int | None = None) -> None:
        if code is not None:
            try:
                self.code = ErrorCode(code)
            except ValueError:
                self.code = ErrorCode.INTERNAL_ERROR
        super().__init__(message or self.code.name)

    def __str__(self) -> str:
        return f"[{self.code.name}] {super().__str__()}"
