"""Typed exceptions of the store client, each carrying the shared :class:`ErrorCode`.

Every failure of a :class:`kvpool.store.Client` call is a :class:`StoreError`
(a :class:`KVPoolError`), so callers can catch one base class and still branch
on ``exc.code`` (the same integer the Mooncake-compatible API returns).
"""

from __future__ import annotations

from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "AlreadyExists",
    "BufferTooSmall",
    "ChecksumMismatch",
    "LeaseExpired",
    "MasterUnreachable",
    "NoSpace",
    "NotEnoughStandbys",
    "ObjectNotFound",
    "QuotaExceeded",
    "StaleEpoch",
    "StoreError",
    "StoreTimeout",
    "TransferFailed",
    "error_for_code",
]


class StoreError(KVPoolError):
    """Base of every store-client error.

    A subclass names the code it stands for (``class X(StoreError,
    code=ErrorCode.Y)``) and, with ``also``, further codes it is raised for:
    :func:`error_for_code` finds it by any of them."""

    code = ErrorCode.INTERNAL_ERROR

    def __init_subclass__(cls, code: ErrorCode | None = None,
                          also: tuple[ErrorCode, ...] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            for c in (code, *also):
                _BY_CODE[c] = cls


_BY_CODE: dict[ErrorCode, type[StoreError]] = {}


class ObjectNotFound(StoreError, code=ErrorCode.OBJECT_NOT_FOUND):
    """The key has no complete replica (never put, removed, evicted or its holder left)."""


class BufferTooSmall(StoreError, code=ErrorCode.BUFFER_OVERFLOW):
    """The destination buffer is smaller than the stored object."""


class NoSpace(StoreError, code=ErrorCode.NO_AVAILABLE_HANDLE):
    """The master could not allocate the requested replicas (pool full, nothing evictable)."""


class QuotaExceeded(StoreError, code=ErrorCode.QUOTA_EXCEEDED):
    """The client's tenant is at its quota (memory, or disk for disk
    replicas) and none of its own objects could be evicted to make room
    (all leased or pinned); nothing was stored (docs/tenants.md). Other
    tenants' objects are never evicted for it."""


class AlreadyExists(StoreError, code=ErrorCode.OBJECT_ALREADY_EXISTS):
    """A put of a key that already exists; the stored value was left unchanged."""


class TransferFailed(StoreError, code=ErrorCode.TRANSFER_FAIL, also=(ErrorCode.WRITE_FAIL,)):
    """Moving the bytes failed on every replica that was tried."""


class StoreTimeout(StoreError, code=ErrorCode.TIMEOUT):
    """A call did not finish within its timeout."""


# WRITE_OUTCOME_UNKNOWN is a timeout: the call may have been applied
class MasterUnreachable(StoreError, code=ErrorCode.RPC_FAIL,
                        also=(ErrorCode.RPC_TIMEOUT, ErrorCode.WRITE_OUTCOME_UNKNOWN)):
    """The master did not answer (RPC_TIMEOUT) or could not be reached (RPC_FAIL)."""


class NotEnoughStandbys(StoreError, code=ErrorCode.NOT_ENOUGH_STANDBYS):
    """The master group's leader has fewer standbys in sync than its
    ``sync_standbys`` (they died or fell behind): the write was refused
    before anything was applied. Reads go on; writes succeed again, with no
    operator action, once a standby is back in sync (docs/ha.md)."""


class LeaseExpired(StoreError, code=ErrorCode.LEASE_EXPIRED):
    """The read lease ran out before the bytes were read; they may have been evicted."""


class ChecksumMismatch(StoreError, code=ErrorCode.CHECKSUM_MISMATCH):
    """The bytes read do not match the checksum recorded at put time."""


class StaleEpoch(StoreError, code=ErrorCode.STALE_EPOCH):
    """A node daemon refused a capability of an older master term (HA
    failover): retryable, a fresh grant from the current leader passes."""


def error_for_code(code: ErrorCode | int, message: str = "") -> StoreError:
    """Build the most specific :class:`StoreError` subclass for ``code``."""
    try:
        ec = ErrorCode(int(code))
    except ValueError:
        ec = ErrorCode.INTERNAL_ERROR
    cls = _BY_CODE.get(ec, StoreError)
    return cls(message or ec.name, ec)
