"""The master's one key check.

A key is valid when it is non-empty, at most ``max_key_length`` characters
and does not start with NUL (``RESERVED_KEY_PREFIX``: the master's own
placeholder keys, refused by every op that names a user's key). A batch is
checked at once at C speed (``min`` and ``max`` over the batch), key by key
only when that finds a bad one; each op's loop then skips the keys marked.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import KEY_MIN

__all__ = ["check_key", "mark_bad_keys"]

_INVALID_KEY = int(ErrorCode.INVALID_KEY)


def mark_bad_keys(keys: Sequence[str], max_key: int, codes: list[int],
                  key_min: str = KEY_MIN) -> bool:
    """Set ``codes[i]`` to INVALID_KEY for every key that is shorter than
    ``key_min`` allows (empty; starting with NUL when ``key_min`` is
    ``KEY_MIN``) or longer than ``max_key``; return whether any was."""
    if not keys or (min(keys) >= key_min and max(map(len, keys)) <= max_key):
        return False
    bad = False
    for i, key in enumerate(keys):
        if key < key_min or len(key) > max_key:
            codes[i] = _INVALID_KEY
            bad = True
    return bad


def check_key(key: str, max_key: int) -> str:
    """``key``, or KVPoolError(INVALID_KEY) when it is not a valid key."""
    if mark_bad_keys((key,), max_key, [0]):
        raise KVPoolError(f"key must be a non-empty string of at most {max_key} characters "
                          "not starting with NUL (reserved)", ErrorCode.INVALID_KEY)
    return key
