"""Tenant names and the master's per-tenant key namespace (docs/tenants.md).

A tenant is a name known to the master. A request names the tenant it acts
for in its ``tenant`` field (empty: ``default``); the master keeps each
tenant's objects under its own namespace, so the same key in two tenants is
two objects and no request of one tenant can name another's object:

- the ``default`` tenant's keys are stored as they are (every deployment from
  before tenants keeps its keys, its journal and its SSD files);
- tenant ``t``'s key ``k`` is stored as ``"\\x1f" + t + "\\x1f" + k``, the
  bytes the Mooncake class used to prefix on the client side, so keys a
  Mooncake store wrote under a ``tenant_id`` stay readable by that tenant.

No caller's key may start below U+0020 (``KEY_MIN``), so no tenant can spell
another's stored key. These helpers are the one place that knows the layout.
"""

from __future__ import annotations

import re

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "DEFAULT_TENANT",
    "MAX_TENANT_LENGTH",
    "TENANT_SEP",
    "scope_prefix",
    "split_scoped",
    "tenant_name",
    "tenant_of",
]

DEFAULT_TENANT = "default"
#: Starts (and ends) a tenant's namespace in a stored key.
TENANT_SEP = "\x1f"
MAX_TENANT_LENGTH = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def tenant_name(name: str | None) -> str:
    """The canonical name of tenant ``name``: ``""``/None -> ``default``.
    Raises KVPoolError(INVALID_PARAMS) unless it is 1-64 of
    ``[A-Za-z0-9._-]``, starting with a letter or digit."""
    if not name:
        return DEFAULT_TENANT
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise KVPoolError(f"invalid tenant name {name!r}: 1-{MAX_TENANT_LENGTH} of "
                          "[A-Za-z0-9._-], starting with a letter or digit",
                          ErrorCode.INVALID_PARAMS)
    return name


def scope_prefix(tenant: str) -> str:
    """What the master puts before a key of canonical tenant ``tenant``
    (empty for ``default``)."""
    return "" if tenant == DEFAULT_TENANT else f"{TENANT_SEP}{tenant}{TENANT_SEP}"


def split_scoped(stored_key: str) -> tuple[str, str]:
    """``(tenant, key)`` of a key as the master stores it."""
    if stored_key.startswith(TENANT_SEP):
        end = stored_key.find(TENANT_SEP, 1)
        if end > 1:
            return stored_key[1:end], stored_key[end + 1:]
    return DEFAULT_TENANT, stored_key


def tenant_of(stored_key: str) -> str:
    """The tenant owning a key as the master stores it."""
    if stored_key.startswith(TENANT_SEP):
        return split_scoped(stored_key)[0]
    return DEFAULT_TENANT
