"""Mooncake's integer return codes: where kvpool's results become them.

The kvpool client reports per-key :class:`~kvpool.core.errors.ErrorCode`
values and raises :class:`~kvpool.core.errors.KVPoolError`; Mooncake's
``MooncakeDistributedStore`` returns integers (0 or a count on success, a
negative code on failure) and never raises for a store error. Every call of
the compatibility layer turns its results into those integers here and
nowhere else:

- kvpool-only codes (below -1000, which Mooncake uses for other things)
  become the nearest Mooncake code, and the original is logged at DEBUG;
- a put of a key that exists counts as stored (Mooncake keeps the value and
  returns 0);
- a read returns the bytes it read, or a negative code.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "INTERNAL",
    "INVALID",
    "NOT_FOUND",
    "NOT_SUPPORTED",
    "TRANSFER_FAIL",
    "code_of",
    "mooncake_code",
    "put_code",
    "put_codes",
    "read_codes",
]

log = logging.getLogger("kvpool.store.mooncake")

# the codes the compatibility layer returns on its own account
INVALID = int(ErrorCode.INVALID_PARAMS)
NOT_SUPPORTED = int(ErrorCode.NOT_SUPPORTED)
INTERNAL = int(ErrorCode.INTERNAL_ERROR)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)

# kvpool-only codes -> the Mooncake code a Mooncake caller expects instead
_TO_MOONCAKE = {
    ErrorCode.UNKNOWN_OP: ErrorCode.RPC_FAIL,
    ErrorCode.MALFORMED_FRAME: ErrorCode.RPC_FAIL,
    ErrorCode.TRANSPORT_UNAVAILABLE: ErrorCode.TRANSFER_FAIL,
    ErrorCode.PERMISSION_DENIED: ErrorCode.TRANSFER_FAIL,
    ErrorCode.STALE_EPOCH: ErrorCode.TRANSFER_FAIL,  # a grant of an older master term
    ErrorCode.OUT_OF_BOUNDS: ErrorCode.INVALID_PARAMS,
    ErrorCode.TOO_MANY_REQUESTS: ErrorCode.RPC_FAIL,
    ErrorCode.FRAME_TOO_LARGE: ErrorCode.INVALID_PARAMS,
    ErrorCode.CONFIG_ERROR: ErrorCode.INVALID_PARAMS,
    ErrorCode.TIMEOUT: ErrorCode.RPC_TIMEOUT,
    ErrorCode.WRITE_OUTCOME_UNKNOWN: ErrorCode.RPC_TIMEOUT,  # as a timeout: may have applied
    ErrorCode.SEGMENT_MISMATCH: ErrorCode.INVALID_PARAMS,
    ErrorCode.CLOSED: ErrorCode.INVALID_PARAMS,
    ErrorCode.BUFFER_OVERFLOW: ErrorCode.INVALID_PARAMS,  # Mooncake: buffer too small
    ErrorCode.INVALID_KEY: ErrorCode.INVALID_PARAMS,
    ErrorCode.QUOTA_EXCEEDED: ErrorCode.NO_AVAILABLE_HANDLE,  # Mooncake's allocation failure
}
_STORED = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)


def mooncake_code(code: int | ErrorCode) -> int:
    """The Mooncake return code for a kvpool :class:`ErrorCode` (0 stays 0)."""
    try:
        ec = ErrorCode(int(code))
    except ValueError:
        return int(code)
    out = _TO_MOONCAKE.get(ec, ec)
    if out is not ec:
        log.debug("kvpool %s reported as Mooncake %s", ec.name, out.name)
    return int(out)


def code_of(exc: BaseException) -> int:
    """The Mooncake return code for an exception (INTERNAL_ERROR if untyped)."""
    if isinstance(exc, KVPoolError):
        return mooncake_code(exc.code)
    log.debug("untyped error: %r", exc)
    return INTERNAL


def put_code(code: ErrorCode) -> int:
    """A put's result: 0 when stored or when the key exists (value kept)."""
    return 0 if code in _STORED else mooncake_code(code)


def put_codes(codes: Sequence[ErrorCode]) -> list[int]:
    """:func:`put_code` of every key of a batch."""
    if codes.count(ErrorCode.OK) == len(codes):  # the common case, without a frame per key
        return [0] * len(codes)
    return [0 if c in _STORED else mooncake_code(c) for c in codes]


def read_codes(results: Sequence[int]) -> list[int]:
    """A batch read's per-key results: the bytes read, or a Mooncake code."""
    if not results or min(results) >= 0:
        return list(results)
    return [r if r >= 0 else mooncake_code(r) for r in results]
