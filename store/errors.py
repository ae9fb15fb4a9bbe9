"""Typed exceptions of the store client, each carrying the shared :class:`ErrorCode`.

Every failure of a :class:`kvpool.store.Client` call is a :class:`StoreError`
(a :class:`KVPoolError`), so callers can catch one base class and still branch
on ``exc.code`` (the same integer the Mooncake-compatible API returns).
"""

from __future__ import annotations

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "AlreadyExists",
    "BufferTooSmall",
    "ChecksumMismatch",
    "LeaseExpired",
    "MasterUnreachable",
    "NoSpace",
    "ObjectNotFound",
    "StaleEpoch",
    "StoreError",
    "StoreTimeout",
    "TransferFailed",
    "error_for_code",
]


class StoreError(KVPoolError):
    """Base of every store-client error."""

    code = ErrorCode.INTERNAL_ERROR


class ObjectNotFound(StoreError):
    """The key has no complete replica (never put, removed, evicted or its holder left)."""

    code = ErrorCode.OBJECT_NOT_FOUND


class BufferTooSmall(StoreError):
    """The destination buffer is smaller than the stored object."""

    code = ErrorCode.BUFFER_OVERFLOW


class NoSpace(StoreError):
    """The master could not allocate the requested replicas (pool full, nothing evictable)."""

    code = ErrorCode.NO_AVAILABLE_HANDLE


class AlreadyExists(StoreError):
    """A put of a key that already exists; the stored value was left unchanged."""

    code = ErrorCode.OBJECT_ALREADY_EXISTS


class TransferFailed(StoreError):
    """Moving the bytes failed on every replica that was tried."""

    code = ErrorCode.TRANSFER_FAIL


class StoreTimeout(StoreError):
    """A call did not finish within its timeout."""

    code = ErrorCode.TIMEOUT


class MasterUnreachable(StoreError):
    """The master did not answer (RPC_TIMEOUT) or could not be reached (RPC_FAIL)."""

    code = ErrorCode.RPC_FAIL


class LeaseExpired(StoreError):
    """The read lease ran out before the bytes were read; they may have been evicted."""

    code = ErrorCode.LEASE_EXPIRED


class ChecksumMismatch(StoreError):
    """The bytes read do not match the checksum recorded at put time."""

    code = ErrorCode.CHECKSUM_MISMATCH


class StaleEpoch(StoreError):
    """A node daemon refused a capability of an older master term (HA
    failover): retryable, a fresh grant from the current leader passes."""

    code = ErrorCode.STALE_EPOCH


_BY_CODE: dict[ErrorCode, type[StoreError]] = {
    ErrorCode.OBJECT_NOT_FOUND: ObjectNotFound,
    ErrorCode.BUFFER_OVERFLOW: BufferTooSmall,
    ErrorCode.NO_AVAILABLE_HANDLE: NoSpace,
    ErrorCode.OBJECT_ALREADY_EXISTS: AlreadyExists,
    ErrorCode.TRANSFER_FAIL: TransferFailed,
    ErrorCode.WRITE_FAIL: TransferFailed,
    ErrorCode.TIMEOUT: StoreTimeout,
    ErrorCode.RPC_FAIL: MasterUnreachable,
    ErrorCode.RPC_TIMEOUT: MasterUnreachable,
    ErrorCode.WRITE_OUTCOME_UNKNOWN: MasterUnreachable,  # as a timeout: may have applied
    ErrorCode.LEASE_EXPIRED: LeaseExpired,
    ErrorCode.CHECKSUM_MISMATCH: ChecksumMismatch,
    ErrorCode.STALE_EPOCH: StaleEpoch,
}


def error_for_code(code: ErrorCode | int, message: str = "") -> StoreError:
    """Build the most specific :class:`StoreError` subclass for ``code``."""
    try:
        ec = ErrorCode(int(code))
    except ValueError:
        ec = ErrorCode.INTERNAL_ERROR
    cls = _BY_CODE.get(ec, StoreError)
    return cls(message or ec.name, ec)
