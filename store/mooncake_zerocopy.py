"""Mooncake's zero-copy calls on kvpool: pointers, multi-buffers and ranges.

Every call moves bytes straight between the caller's memory (host or GPU
addresses; see :mod:`~kvpool.store.mooncake_memory`) and the pool, and costs
at most one master RPC and one transfer batch:

- ``put_from``/``get_into`` and their batch forms: one buffer per object;
- ``batch_put_from_multi_buffers``: each key's object is the concatenation
  of its buffers (vLLM: one buffer per layer/KV segment of a block; SGLang:
  MLA layer-first and hybrid pools); ``batch_get_into_multi_buffers``
  scatters each object over its buffers in order;
- ``get_into_ranges``: byte ranges of several objects gathered into several
  buffers (buffer-major, fragments grouped per key).

Return conventions are Mooncake's (observed on 0.3.13): per key 0 (puts) or
the bytes read (gets), negative codes otherwise; INVALID_PARAMS (-600) for
mismatched list lengths or a buffer too small. Sessions (ranges with no
master RPC) are in :mod:`~kvpool.store.mooncake_session`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.core.errors import KVPoolError
from kvpool.store.config import ReplicateConfig
from kvpool.store.errors import AlreadyExists
from kvpool.store.mooncake_codes import INTERNAL, INVALID, code_of, read_codes
from kvpool.store.mooncake_core import MooncakeCore
from kvpool.store.mooncake_memory import CallerMemory
from kvpool.store.mooncake_objects import ObjectIO

__all__ = ["ZeroCopyCalls"]


class ZeroCopyCalls:
    """The pointer-based calls of one store (module docstring)."""

    def __init__(self, core: MooncakeCore, memory: CallerMemory, io: ObjectIO) -> None:
        self._core = core
        self._memory = memory
        self._io = io

    # ------------------------------------------------------------------ one buffer per object

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None) -> int:
        """Mooncake's ``put_from`` (the kvpool client's single-key put): 0 also
        for an existing key (value kept) and for ``size`` 0 (nothing stored)."""
        if int(size) == 0:
            return 0
        core = self._core
        try:
            core.live().put_from(core.key(key), self._memory.slice(buffer_ptr, size),
                                 core.config(config))
            return 0
        except AlreadyExists:
            return 0
        except KVPoolError as exc:
            return code_of(exc)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Mooncake's ``get_into`` (the kvpool client's single-key read): the
        bytes read, or a Mooncake code (-704 missing, -600 buffer too small)."""
        core = self._core
        try:
            return core.live().get_into(core.key(key), self._memory.slice(buffer_ptr, size))
        except KVPoolError as exc:
            return code_of(exc)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None) -> list[int]:
        """Per key 0 (also when it exists: value kept) or a Mooncake code (-600
        for a size 0; every key -600 when the lists differ in length)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        view = self._memory.slicer()
        try:
            parts = [[view(p, s)] if int(s) > 0 else None
                     for p, s in zip(buffer_ptrs, sizes, strict=True)]
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return self._io.write(keys, parts, config, staged=False)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Per key the bytes read or a Mooncake code; every key -600 when the
        lists differ in length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        if not keys:
            return []
        try:
            view = self._memory.slicer()
            bufs = [view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
            return read_codes(self._core.live().batch_get_into(self._core.keys(keys), bufs))
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig | None) -> int:
        """``[metadata][data]`` from two buffers as one object: 0 or a Mooncake
        code; 0 without storing for ``size`` 0."""
        if int(size) == 0:
            return 0
        if config is not None and config.prefer_alloc_in_same_node:
            return INTERNAL  # Mooncake refuses this combination
        try:
            parts = [self._memory.slice(metadata_buffer_ptr, metadata_size)] \
                if metadata_size else []
            parts.append(self._memory.slice(buffer_ptr, size))
        except KVPoolError as exc:
            return code_of(exc)
        return self._io.write([key], [parts], config, staged=False)[0]

    def upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                    sizes: Sequence[int], config: ReplicateConfig | None) -> list[int]:
        """Insert or replace each key with its buffer; per key 0 or a Mooncake
        code (every key -600 when the lists differ in length)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        try:
            parts = [[self._memory.slice(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)]
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return self._io.write(keys, parts, config, staged=False, upsert=True)

    # ------------------------------------------------------------------ multi-buffers

    def put_multi(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                  all_sizes: Sequence[Sequence[int]],
                  config: ReplicateConfig | None) -> list[int]:
        """Store each key's object as the concatenation of its buffers. Per key
        0 (also when it exists: value kept) or a Mooncake code (-600: list
        lengths differ, or the key's buffers hold 0 bytes)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            return [INVALID] * len(keys)
        if not keys:
            return []
        view = self._memory.slicer()
        parts: list[list[Any] | None] = []
        try:
            for ptrs, sizes in zip(all_buffer_ptrs, all_sizes, strict=True):
                if len(ptrs) != len(sizes) or sum(int(s) for s in sizes) <= 0:
                    parts.append(None)
                    continue
                parts.append([view(p, s) for p, s in zip(ptrs, sizes, strict=True)
                              if int(s) > 0])
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return self._io.write(keys, parts, config, staged=False)

    def get_multi(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                  all_sizes: Sequence[Sequence[int]]) -> list[int]:
        """Scatter each key's object over its buffers in order. Per key the
        object size, or a Mooncake code (-704 missing, -600 when its buffers
        hold fewer bytes than the object or the lists differ in length)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            return [INVALID] * len(keys)
        if not keys:
            return []
        out = [INVALID] * len(keys)
        idx: list[int] = []
        parts: list[list[Any]] = []
        view = self._memory.slicer()
        try:
            client = self._core.live()
            pool_keys = self._core.keys(keys)
            for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
                if len(ptrs) != len(sizes):
                    continue
                idx.append(i)
                parts.append([view(p, s) for p, s in zip(ptrs, sizes, strict=True)])
            results = client.batch_get_parts([pool_keys[i] for i in idx], parts)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, r in zip(idx, read_codes(results), strict=True):
            out[i] = r
        return out

    # ------------------------------------------------------------------ ranges

    def get_into_ranges(self, buffer_ptrs: Sequence[int],
                        all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Gather byte ranges of objects into registered buffers (buffer-major):
        ``results[i][j][k]`` is the bytes read or a Mooncake code (-704 missing
        key; -600 bad shape, a range outside the object or the registered
        buffer, or an unregistered buffer). One master RPC, one transfer batch."""
        n = len(buffer_ptrs)
        shaped = [[[INVALID] * max(len(d), 1) for d in dsts] for dsts in all_dst_offsets] \
            if len(all_dst_offsets) == n else [[[INVALID]] for _ in range(n)]
        if not (len(all_keys) == len(all_dst_offsets) == len(all_src_offsets)
                == len(all_sizes) == n):
            return shaped
        results: list[list[list[int]]] = []
        frags: list[tuple[str, Any, int, int]] = []
        where: list[tuple[int, int, int]] = []
        memory, core = self._memory, self._core
        try:
            client = core.live()
            for i in range(n):
                keys_i = all_keys[i]
                row: list[list[int]] = []
                results.append(row)
                if not (len(keys_i) == len(all_dst_offsets[i]) == len(all_src_offsets[i])
                        == len(all_sizes[i])):
                    row.extend([[INVALID] * max(len(d), 1) for d in all_dst_offsets[i]])
                    continue
                reg = memory.registered(int(buffer_ptrs[i]), 0)
                end = None if reg is None else reg[0].length - reg[1]
                for j, key in enumerate(keys_i):
                    dsts, srcs, sizes = (all_dst_offsets[i][j], all_src_offsets[i][j],
                                         all_sizes[i][j])
                    if not (len(dsts) == len(srcs) == len(sizes)):
                        row.append([INVALID] * max(len(dsts), 1))
                        continue
                    cells = [INVALID] * len(dsts)
                    row.append(cells)
                    k = core.key_or_none(key)
                    for f, (dst, src, size) in enumerate(zip(dsts, srcs, sizes, strict=True)):
                        dst, src, size = int(dst), int(src), int(size)
                        if k is None or end is None or dst < 0 or size < 0 or dst + size > end:
                            continue
                        frags.append((k, memory.slice(int(buffer_ptrs[i]) + dst, size), src,
                                      size))
                        where.append((i, j, f))
            got = client.batch_get_ranges(frags) if frags else []
        except KVPoolError as exc:
            code = code_of(exc)
            return [[[code] * len(c) for c in row] for row in (results or shaped)]
        for (i, j, f), r in zip(where, read_codes(got), strict=True):
            results[i][j][f] = r
        return results
