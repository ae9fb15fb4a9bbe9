"""A batch's keys: the master's one key check, and the per-key result codes.

A key is valid when it is non-empty, at most ``max_key_length`` characters
and does not start below U+0020 (``KEY_MIN``: the master's own placeholder
keys start with NUL, tenants' namespaces with U+001F; refused by every op
that names a user's key). A batch is
checked at once at C speed (``min`` and ``max`` over the batch), key by key
only when that finds a bad one; each op's loop then skips the keys marked.

A batch answers a code per key; the codes are plain ints (the list is
encoded into the reply as it is), named here once.

A request acts for a tenant (:mod:`kvpool.core.tenants`): its :class:`Scope`
turns the caller's keys into the keys the directory stores. The default
tenant's keys are stored as they are (no copy, no loop). Another tenant's
keys are prefixed with the tenant's namespace, unchecked. Either way the
directory's own check of the stored keys is their one check: against the
scope's ``key_min`` (the namespace followed by U+0020) and ``max_key``
(the ``max_key_length`` plus the namespace's length), a stored key passes
exactly when the caller's key would pass as a default key, so the codes of
a batch come out of the one directory pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import KEY_MIN, RESERVED_KEY_PREFIX
from kvpool.core.tenants import DEFAULT_TENANT, TENANT_SEP, scope_prefix, tenant_name

__all__ = [
    "DENIED",
    "EXISTS",
    "HAS_LEASE",
    "INVALID_KEY",
    "INVALID_PARAMS",
    "INVALID_WRITE",
    "NOT_FOUND",
    "NOT_READY",
    "Scope",
    "Scopes",
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


class Scope:
    """One tenant's namespace as the master applies it to a request's keys
    (see the module docstring). ``prefix`` is empty for the default tenant;
    ``key_min`` and ``max_key`` are what the directory checks stored keys
    against: ``prefix + KEY_MIN`` and the caller's limit plus the prefix's
    length (a stored key below ``key_min`` is the prefix followed by an
    empty key or one starting below U+0020)."""

    __slots__ = ("default", "key_min", "max_key", "prefix", "tenant", "user_max")

    def __init__(self, tenant: str, max_key: int) -> None:
        self.tenant = tenant
        self.prefix = scope_prefix(tenant)
        self.default = not self.prefix
        self.user_max = max_key
        self.key_min = self.prefix + KEY_MIN
        self.max_key = max_key + len(self.prefix)

    def keys(self, keys: Sequence[str]) -> Sequence[str]:
        """The stored keys of the caller's ``keys`` (unchecked: the
        directory checks them against ``key_min`` and ``max_key``): ``keys``
        itself for the default tenant, else each prefixed."""
        p = self.prefix
        if not p:
            return keys
        if len(keys) == 1:  # a single-key op's (no comprehension to set up)
            return [p + keys[0]]
        # (a comprehension's str + str is a specialized op: a quarter faster
        # than map(p.__add__, keys), whose method-wrapper call is generic)
        return [p + k for k in keys]

    def key(self, key: str) -> str:
        """The stored key of the caller's ``key`` (unchecked, as :meth:`keys`)."""
        return self.prefix + key

    def own_keys(self, keys: Sequence[str]) -> list[str]:
        """The stored keys of a PUT_REVOKE's ``keys``: a reservation's
        placeholder (``RESERVED_KEY_PREFIX``; the caller's own, checked by
        client id) as it is, a key as :meth:`key` scopes it (for the default
        tenant too: one starting below U+0020 becomes ``""``)."""
        p = self.prefix
        mx = self.user_max
        return [k if k.startswith(RESERVED_KEY_PREFIX)
                else "" if _bad(k, mx, KEY_MIN) else p + k for k in keys]

    def user_key(self, stored: str) -> str:
        """The caller's key of a key of this scope as stored."""
        return stored[len(self.prefix):]

    def owns(self, stored: str) -> bool:
        """Whether the stored key ``stored`` is this tenant's."""
        p = self.prefix
        return stored.startswith(p) if p else not stored.startswith(TENANT_SEP)


class Scopes:
    """The :class:`Scope` of each tenant a request names, made once per name
    (the validation included); an invalid name raises
    KVPoolError(INVALID_PARAMS). A bounded cache: names beyond ``limit``
    start it over. ``guard`` (the master's ``tenant_keys``): called with a
    canonical tenant name other than default on every request that names
    one; it raises to refuse the request (PERMISSION_DENIED)."""

    def __init__(self, max_key: int, limit: int = 4096,
                 guard: Callable[[str], None] | None = None) -> None:
        self.max_key = max_key
        self.limit = limit
        self.guard = guard
        self.default = Scope(DEFAULT_TENANT, max_key)
        # the scopes a request gets at one lookup: the default tenant's, and
        # without a guard every tenant's
        self._all: dict[str, Scope] = {}
        self._named: dict[str, Scope] = {}  # with a guard: checked on each request
        self._reset()

    def _reset(self) -> None:
        self._all = {"": self.default, DEFAULT_TENANT: self.default}
        self._named = {}

    def of(self, tenant: str) -> Scope:
        """The scope of a request's ``tenant`` field."""
        try:
            return self._all[tenant]
        except KeyError:
            return self._other(tenant)

    def _other(self, tenant: str) -> Scope:
        s = self._named.get(tenant)
        if s is None:
            name = tenant_name(tenant)
            if len(self._all) + len(self._named) >= self.limit:
                self._reset()
            s = Scope(name, self.max_key)
            if self.guard is None:
                self._all[tenant] = s
            else:
                self._named[tenant] = s
        if self.guard is not None:
            self.guard(s.tenant)
        return s
