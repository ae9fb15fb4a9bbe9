"""Mooncake's calls on keys and bytes values: put/get, batches, parts, upserts, queries.

These are the calls Mooncake stages through its ``local_buffer_size``
buffer (kvpool copies straight between the caller's objects and the pool,
but keeps the limit per call), plus existence, size and removal. A single
``put``/``get``/``is_exist`` is the kvpool client's own single-key call
(its fast path); the batch forms go through
:class:`~kvpool.store.mooncake_objects.ObjectIO`, one master RPC and one
transfer batch a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.core.errors import KVPoolError
from kvpool.store.config import ReplicateConfig
from kvpool.store.errors import AlreadyExists, ObjectNotFound
from kvpool.store.mooncake_codes import INVALID, code_of, log, mooncake_code
from kvpool.store.mooncake_core import MooncakeCore
from kvpool.store.mooncake_objects import ObjectIO

__all__ = ["BytesCalls", "part_views"]


def part_views(parts: Sequence[Any]) -> list[memoryview]:
    """The parts of ``put_parts``/``upsert_parts``: 1-D bytes-like objects
    (Mooncake's rule; RuntimeError otherwise)."""
    views = [memoryview(p) for p in parts]
    if any(v.ndim != 1 or v.itemsize != 1 for v in views):
        raise RuntimeError("parts must be 1-D bytes-like")
    return views


class BytesCalls:
    """The bytes and query calls of one store (module docstring)."""

    def __init__(self, core: MooncakeCore, io: ObjectIO) -> None:
        self._core = core
        self._io = io

    # ------------------------------------------------------------------ bytes

    def put(self, key: str, value: Any, config: ReplicateConfig | None) -> int:
        """Mooncake's ``put``: 0 also for an existing key (value kept)."""
        core = self._core
        try:
            view = memoryview(value)
            if view.nbytes == 0 or not core.fits_staging(view.nbytes):
                return INVALID
            core.live().put(core.key(key), view, core.config(config))
            return 0
        except AlreadyExists:
            return 0
        except KVPoolError as exc:
            return code_of(exc)

    def get(self, key: str) -> bytes:
        """Mooncake's ``get``: ``b""`` when missing, unreadable or larger than
        ``local_buffer_size``."""
        core = self._core
        k = core.key_or_none(key)
        if k is None or core.client is None:
            return b""
        try:
            value = core.client.get(k)
        except ObjectNotFound:
            return b""
        except KVPoolError as exc:
            log.debug("get %r: %s", key, exc)
            return b""
        return value if core.fits_staging(len(value)) else b""

    def write(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]],
              config: ReplicateConfig | None, upsert: bool) -> list[int]:
        """Put (or upsert) each key's parts as one object; a key whose parts
        hold no bytes is INVALID_PARAMS. Per key 0 or a Mooncake code."""
        sized = [ps if sum(v.nbytes for v in ps) else None for ps in parts]
        return self._io.write(keys, sized, config, staged=True, upsert=upsert)

    def write_values(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None, upsert: bool) -> int:
        """Put (or upsert) bytes-like values: 0 or the first negative code
        (INVALID_PARAMS when the lists differ in length)."""
        if len(keys) != len(values):
            return INVALID
        codes = self.write(keys, [[memoryview(v)] for v in values], config, upsert)
        return next((c for c in codes if c != 0), 0)

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Values in key order, ``b""`` where missing."""
        return [bytes(h) if h is not None else b"" for h in self._io.read(keys)]

    # ------------------------------------------------------------------ queries, removal

    def is_exist(self, key: str) -> int:
        """Mooncake's ``is_exist`` (the kvpool client's single-key query): 1,
        0 (also for an empty key) or -1 on error."""
        core = self._core
        k = core.key_or_none(key)
        if k is None:
            return 0
        try:
            return 1 if core.live().exists(k) else 0
        except KVPoolError:
            return -1

    def exist(self, keys: Sequence[str]) -> list[int]:
        """1/0/-1 per key in input order (0 also for an empty key); [] for []."""
        if not keys:
            return []
        out = [0] * len(keys)
        valid = self._core.valid_keys(keys)
        if not valid:
            return out
        try:
            found = self._core.live().batch_exists([k for _, k in valid])
        except KVPoolError:
            return [-1] * len(keys)
        for (i, _k), e in zip(valid, found, strict=True):
            out[i] = 1 if e else 0
        return out

    def get_size(self, key: str) -> int:
        """Size of ``key``'s value, or a Mooncake code."""
        try:
            return self._core.live().get_size(self._core.key(key))
        except KVPoolError as exc:
            return code_of(exc)

    def remove(self, keys: Sequence[str], force: bool) -> list[int]:
        """Remove ``keys`` in one RPC; per key 0 or a Mooncake code."""
        try:
            return [mooncake_code(c)
                    for c in self._core.live().batch_remove(self._core.keys(keys), force)]
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)

    def remove_where(self, pattern: str, force: bool) -> int:
        """Remove the keys of this store's tenant that ``pattern`` finds
        (``re.search``): the count or a Mooncake code."""
        try:  # the master keeps the removal inside the client's tenant
            return self._core.live().remove_by_regex(str(pattern), force)
        except KVPoolError as exc:
            return code_of(exc)

    def remove_all(self, force: bool) -> int:
        """Remove every object of this store's tenant: the count or a Mooncake code."""
        try:  # the master keeps the removal inside the client's tenant
            return self._core.live().remove_all(force)
        except KVPoolError as exc:
            return code_of(exc)
