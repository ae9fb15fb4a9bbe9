"""The state every part of one Mooncake-compatible store shares.

``MooncakeDistributedStore`` (store/mooncake_store.py) is a facade over rooms, one
per family of calls (setup, bytes, zero copy, sessions, tensors,
administration); they all hold the one :class:`MooncakeCore` of their store:

- the kvpool :class:`~kvpool.store.client.Client` behind the store, None
  while it is not set up (a call then fails with ``INVALID_PARAMS``, as
  Mooncake's "client is not initialized");
- ``tenant_id`` is the client's tenant (``ClientConfig.tenant``): the master
  keeps each tenant's keys apart (docs/tenants.md), so the keys here are the
  caller's as they are. No caller key may start below U+0020 (``KEY_MIN``);
- ``local_buffer_size``: Mooncake stages every non-zero-copy call (bytes
  put/get, parts, buffers, tensors) through a buffer of this size, and a call
  that needs more fails. kvpool copies straight between the caller's memory
  and the pool, but keeps that limit per call so programs behave the same;
- a write's ``ReplicateConfig``, checked the way Mooncake checks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvpool.core.config import parse_size
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import KEY_MIN
from kvpool.store.client import Client
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_codes import log

__all__ = [
    "MooncakeCore",
    "NotSetUp",
    "mooncake_size",
    "pick_groups",
]

_STR_ONLY = {str}


def mooncake_size(value: Any) -> int:
    """A size as Mooncake's setup reads it: an int, or a string whose units
    (K/KB, M/MB, G/GB, T/TB, and kvpool's KiB, MiB, ...) are all powers of 1024
    (:func:`~kvpool.core.config.parse_size` with ``binary_units``).
    Raises KVPoolError(INVALID_PARAMS)."""
    try:
        return parse_size(value, binary_units=True)
    except KVPoolError:
        raise KVPoolError(f"not a size: {value!r}", ErrorCode.INVALID_PARAMS) from None


def pick_groups(cfg: ReplicateConfig | None, idx: Sequence[int]) -> ReplicateConfig | None:
    """``cfg`` with ``group_ids`` (one per key of a call) kept for the keys at
    ``idx`` only, in that order (Mooncake filters them the same way when it
    skips keys)."""
    if cfg is None or cfg.group_ids is None:
        return cfg
    groups = cfg.group_ids
    return dataclasses.replace(cfg, group_ids=[groups[i] for i in idx])


class NotSetUp(KVPoolError):
    """A call on a store that is not set up (or was closed)."""

    code = ErrorCode.INVALID_PARAMS


class MooncakeCore:
    """The client, key checks, staging limit and config rules of one store
    (module docstring)."""

    def __init__(self) -> None:
        self.client: Client | None = None
        self.hostname = ""
        self.local_buffer_size = 16 << 20

    def live(self) -> Client:
        """The client; raises :class:`NotSetUp` before setup and after close."""
        client = self.client
        if client is None:
            raise NotSetUp("store is not set up (call setup() first)")
        return client

    def key(self, key: str) -> str:
        """Caller key ``key``, checked. Raises TypeError for a non-str,
        KVPoolError(INVALID_PARAMS) for an empty key or one starting below
        U+0020 (the master's reserved and tenant-namespace prefixes)."""
        if not isinstance(key, str):
            raise TypeError(f"key must be str, got {type(key).__name__}")
        if key < KEY_MIN:
            raise KVPoolError(f"invalid key {key!r}", ErrorCode.INVALID_PARAMS)
        return key

    def _all_valid(self, keys: Sequence[str]) -> list[str] | None:
        """The keys when every key is a str starting at or above " " (the
        common case, checked without a frame per key), else None."""
        if keys and set(map(type, keys)) == _STR_ONLY and min(keys) >= KEY_MIN:
            return list(keys)
        return None

    def keys(self, keys: Sequence[str]) -> list[str]:
        """Every key checked by :meth:`key` (raises for the first invalid one)."""
        pool = self._all_valid(keys)
        return pool if pool is not None else [self.key(k) for k in keys]

    def key_or_none(self, key: str) -> str | None:
        """:meth:`key`, or None for a key Mooncake treats as absent (empty...)."""
        try:
            return self.key(key)
        except KVPoolError:
            return None

    def valid_keys(self, keys: Sequence[str]) -> list[tuple[int, str]]:
        """``(position, key)`` of the keys Mooncake does not treat as absent."""
        pool = self._all_valid(keys)
        if pool is not None:
            return list(enumerate(pool))
        return [(i, k) for i, k in ((i, self.key_or_none(k)) for i, k in enumerate(keys))
                if k is not None]

    def fits_staging(self, nbytes: int) -> bool:
        """Whether a non-zero-copy call of ``nbytes`` fits Mooncake's staging
        buffer (``local_buffer_size``; module docstring). Logs when not."""
        if nbytes <= self.local_buffer_size:
            return True
        log.error("%d bytes do not fit local_buffer_size (%d); use the zero-copy calls "
                  "or a larger local_buffer_size", nbytes, self.local_buffer_size)
        return False

    def config(self, config: ReplicateConfig | None, keys: int = 1) -> ReplicateConfig | None:
        """Check a write's ReplicateConfig for ``keys`` objects the way Mooncake
        does and apply what kvpool maps onto its own placement. Raises
        TypeError (not a ReplicateConfig) or KVPoolError."""
        if config is None:
            return None
        if not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        why = config.mooncake_error(keys)
        if why is not None:
            raise KVPoolError(why, ErrorCode.INVALID_PARAMS)
        if config.dfs_replica_num:
            raise KVPoolError("kvpool has no distributed-filesystem tier (dfs_replica_num); "
                              "use disk replicas (nof_replica_num / disk_replica_num)",
                              ErrorCode.NOT_SUPPORTED)
        if config.prefer_alloc_in_same_node and self.client is not None:
            own = self.client.segment_ids
            if own and own[0] not in config.segments():
                config = dataclasses.replace(
                    config, preferred_segments=[own[0], *config.preferred_segments])
        return config
