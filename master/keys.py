"""A batch's keys: the master's one key check, and the per-key result codes.

A key is valid when it is non-empty, at most ``max_key_length`` characters
and does not start below U+0020 (``KEY_MIN``: the master's own placeholder
keys start with NUL, tenants' namespaces with U+001F; refused by every op
that names a user's key). A batch is
checked at once at C speed (``min`` and ``max`` over the batch), key by key
only when that finds a bad one; each op's loop then skips the keys marked.

A batch answers a code per key; the codes are plain ints (the list is
encoded into the reply as it is), named here once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import KEY_MIN

__all__ = [
    "DENIED",
    "EXISTS",
    "HAS_LEASE",
    "INVALID_KEY",
    "INVALID_PARAMS",
    "INVALID_WRITE",
    "NOT_FOUND",
    "NOT_READY",
    "check_key",
    "mark_bad_keys",
    "valid_keys",
]

INVALID_KEY = int(ErrorCode.INVALID_KEY)
INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
NOT_READY = int(ErrorCode.REPLICA_IS_NOT_READY)
INVALID_WRITE = int(ErrorCode.INVALID_WRITE)
HAS_LEASE = int(ErrorCode.OBJECT_HAS_LEASE)
DENIED = int(ErrorCode.PERMISSION_DENIED)


def mark_bad_keys(keys: Sequence[str], max_key: int, codes: list[int],
                  key_min: str = KEY_MIN) -> bool:
    """Set ``codes[i]`` to INVALID_KEY for every key that is shorter than
    ``key_min`` allows (empty; starting below U+0020 when ``key_min`` is
    ``KEY_MIN``) or longer than ``max_key``; return whether any was."""
    if len(keys) == 1:  # a single-key op: no pass over the batch
        key = keys[0]
        if key >= key_min and len(key) <= max_key:
            return False
    elif not keys or (min(keys) >= key_min and max(map(len, keys)) <= max_key):
        return False
    bad = False
    for i, key in enumerate(keys):
        if _bad(key, max_key, key_min):
            codes[i] = INVALID_KEY
            bad = True
    return bad


def _bad(key: str, max_key: int, key_min: str) -> bool:
    """Whether ``key`` is not a valid key (see the module docstring)."""
    return key < key_min or len(key) > max_key


def valid_keys(keys: Sequence[str], max_key: int, codes: list[int],
               key_min: str = KEY_MIN) -> Iterable[tuple[int, str]]:
    """``(i, key)`` of each valid key of a batch, INVALID_KEY set in ``codes``
    for the others (:func:`mark_bad_keys`): the loop of an op whose per-key
    step is not a hot path."""
    if mark_bad_keys(keys, max_key, codes, key_min):
        return [(i, k) for i, k in enumerate(keys) if not codes[i]]
    return enumerate(keys)


def check_key(key: str, max_key: int) -> str:
    """``key``, or KVPoolError(INVALID_KEY) when it is not a valid key."""
    if _bad(key, max_key, KEY_MIN):
        raise KVPoolError(f"key must be a non-empty string of at most {max_key} characters "
                          "not starting below U+0020 (reserved)", ErrorCode.INVALID_KEY)
    return key
