"""Mooncake's zero-copy calls on kvpool: pointers, multi-buffers, ranges, sessions.

Every call moves bytes straight between the caller's memory (host or GPU
addresses; ``register_buffer`` regions are looked up, unregistered host
memory works too) and the pool, and costs at most one master RPC and one
transfer batch:

- ``batch_put_from_multi_buffers``: each key's object is the concatenation
  of its buffers (vLLM: one buffer per layer/KV segment of a block; SGLang:
  MLA layer-first and hybrid pools); ``batch_get_into_multi_buffers``
  scatters each object over its buffers in order;
- ``get_into_ranges``: byte ranges of several objects gathered into several
  buffers (buffer-major, fragments grouped per key);
- sessions: ``batch_get_session_start`` locates objects once (read lease),
  then ``batch_get_into_multi_buffer_ranges`` reads ranges with no master RPC;
  ``batch_put_session_start`` reserves objects, ranges are written with no
  RPC, ``batch_put_session_end`` commits (``..._revoke`` aborts).

Return conventions are Mooncake's (observed on 0.3.13): per key 0 (puts) or
the bytes read (gets), negative codes otherwise; INVALID_PARAMS (-600) for
mismatched list lengths, a buffer too small, a missing session.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store.client import Location, RangeRead, RangeWrite, Reservation
from kvpool.store.config import ReplicateConfig
from kvpool.store.errors import AlreadyExists
from kvpool.store.mooncake_core import (
    INVALID,
    MooncakeCore,
    code_of,
    log,
    mooncake_code,
)

__all__ = ["ZeroCopyCalls"]

_OK_PUT = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)


def _put_code(code: ErrorCode) -> int:
    """A put's Mooncake result: an existing key counts as stored (value kept)."""
    return 0 if code in _OK_PUT else mooncake_code(code)


class ZeroCopyCalls(MooncakeCore):
    """The pointer-based calls of ``MooncakeDistributedStore`` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._get_sessions: dict[str, Location] = {}
        self._put_sessions: dict[str, Reservation] = {}
        self._sess_lock = threading.Lock()

    # ------------------------------------------------------------------ registration

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` (host or GPU) for zero-copy
        calls; registering the same address again replaces it. 0 or negative."""
        try:
            self._register(int(buffer_ptr), int(size))
            return 0
        except KVPoolError as exc:
            return code_of(exc)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Release a :meth:`register_buffer` region; INVALID_PARAMS if unknown."""
        try:
            self._c()
            return 0 if self._unregister(int(buffer_ptr)) else INVALID
        except KVPoolError as exc:
            return code_of(exc)

    def alloc_from_mem_pool(self, size: int) -> int:
        """Mooncake: an address in a dummy client's shared pool, 0 for a real
        client. kvpool needs no pool for zero-copy calls: returns 0."""
        return 0

    # ------------------------------------------------------------------ single buffers

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr``. 0 (also for an existing key,
        whose value is kept, and for ``size`` 0, which stores nothing) or a
        negative code."""
        if int(size) == 0:
            return 0
        try:
            self._c().put_from(self._k(key), self._slice(buffer_ptr, size),
                               self._config(config))
            return 0
        except AlreadyExists:
            return 0
        except KVPoolError as exc:
            return code_of(exc)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into ``size`` bytes at ``buffer_ptr``: the bytes read, or
        a negative code (-704 missing, -600 buffer too small: nothing read)."""
        try:
            return self._c().get_into(self._k(key), self._slice(buffer_ptr, size))
        except KVPoolError as exc:
            return code_of(exc)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """:meth:`put_from` for many keys: one master RPC, one transfer batch.
        Every key -600 when the lists differ in length; -600 for a size 0."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        return self.batch_put_from_multi_buffers(
            keys, [[p] for p in buffer_ptrs], [[s] for s in sizes], config)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """:meth:`get_into` for many keys: one master RPC, one transfer batch.
        Every key -600 when the lists differ in length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        if not keys:
            return []
        try:
            view = self._slicer()
            bufs = [view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
            return [mooncake_code(r) if r < 0 else r
                    for r in self._c().batch_get_into(self._ks(keys), bufs)]
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig | None = None) -> int:
        """Store ``[metadata][data]`` (metadata first) from two buffers as one
        object. 0 or a negative code; 0 without storing for ``size`` 0."""
        if int(size) == 0:
            return 0
        if config is not None and config.prefer_alloc_in_same_node:
            return int(ErrorCode.INTERNAL_ERROR)  # Mooncake refuses this combination
        try:
            parts = [self._slice(metadata_buffer_ptr, metadata_size)] if metadata_size else []
            parts.append(self._slice(buffer_ptr, size))
            (code,) = self._c().batch_put_parts([self._k(key)], [parts], self._config(config))
            return _put_code(code)
        except KVPoolError as exc:
            return code_of(exc)

    # ------------------------------------------------------------------ upsert from pointers

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` with ``size`` bytes at ``buffer_ptr``."""
        try:
            part = self._slice(buffer_ptr, size)
        except KVPoolError as exc:
            return code_of(exc)
        return self._upsert_many([key], [[part]], config, staged=False)[0]

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        """:meth:`upsert_from` for many keys; per key 0 or a negative code."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        try:
            parts = [[self._slice(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)]
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return self._upsert_many(keys, parts, config, staged=False)

    # ------------------------------------------------------------------ multi-buffers

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Store each key's object as the concatenation of its buffers: one
        master RPC and one transfer batch for the whole call. Per key 0 (also
        when it exists: value kept) or a negative code (-600: list lengths
        differ, or the key's buffers hold 0 bytes)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            return [INVALID] * len(keys)
        if not keys:
            return []
        try:
            client = self._c()
            cfg = self._config(config, len(keys))
            pool_keys = self._ks(keys)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        out = [INVALID] * len(keys)
        idx: list[int] = []
        parts: list[list[Any]] = []
        view = self._slicer()
        try:
            for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
                if len(ptrs) != len(sizes) or sum(int(s) for s in sizes) <= 0:
                    continue
                idx.append(i)
                parts.append([view(p, s) for p, s in zip(ptrs, sizes, strict=True)
                              if int(s) > 0])
            if cfg is not None and cfg.group_ids is not None:
                cfg = _pick_groups(cfg, idx)
            codes = client.batch_put_parts([pool_keys[i] for i in idx], parts, cfg)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, c in zip(idx, codes, strict=True):
            out[i] = _put_code(c)
        return out

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Scatter each key's object over its buffers in order (the first buffer
        gets the first bytes): one master RPC and one transfer batch. Per key
        the object size, or a negative code (-704 missing, -600 when its
        buffers hold fewer bytes than the object or the lists differ in
        length). ``prefer_alloc_in_same_node`` is accepted: kvpool always reads
        the nearest replica first."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
            return [INVALID] * len(keys)
        if not keys:
            return []
        out = [INVALID] * len(keys)
        idx: list[int] = []
        parts: list[list[Any]] = []
        view = self._slicer()
        try:
            client = self._c()
            pool_keys = self._ks(keys)
            for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
                if len(ptrs) != len(sizes):
                    continue
                idx.append(i)
                parts.append([view(p, s) for p, s in zip(ptrs, sizes, strict=True)])
            results = client.batch_get_parts([pool_keys[i] for i in idx], parts)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, r in zip(idx, results, strict=True):
            out[i] = r if r >= 0 else mooncake_code(r)
        return out

    # ------------------------------------------------------------------ ranges

    def get_into_ranges(self, buffer_ptrs: Sequence[int],
                        all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Gather byte ranges of objects into registered buffers (buffer-major):
        ``all_sizes[i][j][k]`` bytes from ``all_src_offsets[i][j][k]`` of
        object ``all_keys[i][j]`` land at ``all_dst_offsets[i][j][k]`` of
        ``buffer_ptrs[i]``. One master RPC for the distinct keys, one transfer
        batch. ``results[i][j][k]`` is the bytes read or a negative code (-704
        missing key; -600 bad shape, a range outside the object or the
        registered buffer, or an unregistered buffer)."""
        n = len(buffer_ptrs)
        shaped = [[[INVALID] * max(len(d), 1) for d in dsts] for dsts in all_dst_offsets] \
            if len(all_dst_offsets) == n else [[[INVALID]] for _ in range(n)]
        if not (len(all_keys) == len(all_dst_offsets) == len(all_src_offsets)
                == len(all_sizes) == n):
            return shaped
        results: list[list[list[int]]] = []
        frags: list[tuple[str, Any, int, int]] = []
        where: list[tuple[int, int, int]] = []
        try:
            client = self._c()
            for i in range(n):
                keys_i = all_keys[i]
                row: list[list[int]] = []
                results.append(row)
                if not (len(keys_i) == len(all_dst_offsets[i]) == len(all_src_offsets[i])
                        == len(all_sizes[i])):
                    row.extend([[INVALID] * max(len(d), 1) for d in all_dst_offsets[i]])
                    continue
                reg = self._registered(int(buffer_ptrs[i]), 0)
                end = None if reg is None else reg[0].length - reg[1]
                for j, key in enumerate(keys_i):
                    dsts, srcs, sizes = (all_dst_offsets[i][j], all_src_offsets[i][j],
                                         all_sizes[i][j])
                    if not (len(dsts) == len(srcs) == len(sizes)):
                        row.append([INVALID] * max(len(dsts), 1))
                        continue
                    cells = [INVALID] * len(dsts)
                    row.append(cells)
                    k = self._k_or_none(key)
                    for f, (dst, src, size) in enumerate(zip(dsts, srcs, sizes, strict=True)):
                        dst, src, size = int(dst), int(src), int(size)
                        if k is None or end is None or dst < 0 or size < 0 or dst + size > end:
                            continue
                        frags.append((k, self._slice(int(buffer_ptrs[i]) + dst, size), src, size))
                        where.append((i, j, f))
            got = client.batch_get_ranges(frags) if frags else []
        except KVPoolError as exc:
            code = code_of(exc)
            return [[[code] * len(c) for c in row] for row in (results or shaped)]
        for (i, j, f), r in zip(where, got, strict=True):
            results[i][j][f] = r if r >= 0 else mooncake_code(r)
        return results

    # ------------------------------------------------------------------ get sessions

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Locate ``keys`` once (one master RPC; a read lease each) for
        :meth:`batch_get_into_multi_buffer_ranges`. Per key 0 or a negative
        code (-704 missing)."""
        if not keys:
            return []
        try:
            pool_keys = self._ks(keys)
            locs = self._c().batch_locate(pool_keys)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        out: list[int] = []
        with self._sess_lock:
            for k, loc in zip(pool_keys, locs, strict=True):
                if loc.code == ErrorCode.OK:
                    self._get_sessions[k] = loc
                    out.append(0)
                else:
                    self._get_sessions.pop(k, None)
                    out.append(mooncake_code(loc.code))
        return out

    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Read ranges of session objects into buffers with no master RPC: for
        key i, ``all_sizes[i][j]`` bytes from object offset
        ``all_src_offsets[i][j]`` into ``all_buffer_ptrs[i][j]``. Per key the
        bytes read, or a negative code (-600 no session or bad range, -707 the
        session's read lease ended)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets)):
            return [INVALID] * len(keys)
        out = [INVALID] * len(keys)
        reads: list[RangeRead] = []
        owner: list[int] = []
        try:
            client = self._c()
            for i, key in enumerate(keys):
                ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_src_offsets[i]
                k = self._k_or_none(key)
                with self._sess_lock:
                    loc = self._get_sessions.get(k) if k is not None else None
                if loc is None or not (len(ptrs) == len(sizes) == len(offs)):
                    continue
                out[i] = 0
                for p, s, o in zip(ptrs, sizes, offs, strict=True):
                    reads.append(RangeRead(loc, self._slice(p, s), int(o), int(s)))
                    owner.append(i)
            got = client.read_ranges(reads) if reads else []
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, r in zip(owner, got, strict=True):
            if out[i] < 0:
                continue
            out[i] = out[i] + r if r >= 0 else mooncake_code(r)
        return out

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        """Drop the get sessions of ``keys`` (their leases simply run out). 0."""
        with self._sess_lock:
            for key in keys:
                k = self._k_or_none(key)
                if k is not None:
                    self._get_sessions.pop(k, None)
        return 0

    # ------------------------------------------------------------------ put sessions

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int],
                                config: ReplicateConfig | None = None) -> list[int]:
        """Reserve ``sizes[i]`` bytes for each key (one master RPC, no data).
        Per key 0, -705 (exists), -600 (a session is already open, bad size)."""
        if len(keys) != len(sizes):
            return [INVALID] * len(keys)
        out = [INVALID] * len(keys)
        try:
            client = self._c()
            cfg = self._config(config, len(keys))
            pool_keys = self._ks(keys)
            with self._sess_lock:
                idx = [i for i, k in enumerate(pool_keys) if k not in self._put_sessions]
            if cfg is not None and cfg.group_ids is not None:
                cfg = _pick_groups(cfg, idx)
            held = client.batch_put_reserve([pool_keys[i] for i in idx],
                                            [int(sizes[i]) for i in idx], cfg)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        with self._sess_lock:
            for i, rv in zip(idx, held, strict=True):
                if rv.code == ErrorCode.OK:
                    self._put_sessions[pool_keys[i]] = rv
                    out[i] = 0
                else:
                    out[i] = mooncake_code(rv.code)
        return out

    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Write buffers into ranges of session objects with no master RPC: for
        key i, ``all_sizes[i][j]`` bytes of ``all_buffer_ptrs[i][j]`` at object
        offset ``all_dst_offsets[i][j]``. Per key the bytes written, or a
        negative code (-600 no session or a range outside the object)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets)):
            return [INVALID] * len(keys)
        out = [INVALID] * len(keys)
        writes: list[RangeWrite] = []
        owner: list[int] = []
        try:
            client = self._c()
            for i, key in enumerate(keys):
                ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_dst_offsets[i]
                k = self._k_or_none(key)
                with self._sess_lock:
                    rv = self._put_sessions.get(k) if k is not None else None
                if rv is None or not (len(ptrs) == len(sizes) == len(offs)):
                    continue
                out[i] = sum(int(s) for s in sizes)
                for p, s, o in zip(ptrs, sizes, offs, strict=True):
                    writes.append(RangeWrite(self._slice(p, s), rv.replicas, int(o), int(s),
                                             rv.caps))
                    owner.append(i)
            done = client.write_ranges(writes) if writes else []
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, (ok, err) in zip(owner, done, strict=True):
            if not ok and out[i] >= 0:
                log.debug("range write of %r failed: %s", keys[i], err)
                out[i] = INVALID if "outside" in err else int(ErrorCode.TRANSFER_FAIL)
        return out

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Commit put sessions: the objects become readable. Per key 0 or a
        negative code (-600 no session)."""
        return self._finish_put_sessions(keys, commit=True)

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        """Abort put sessions and release their space. Per key 0 or -600."""
        return self._finish_put_sessions(keys, commit=False)

    def _finish_put_sessions(self, keys: Sequence[str], commit: bool) -> list[int]:
        out = [INVALID] * len(keys)
        idx: list[int] = []
        pool: list[str] = []
        with self._sess_lock:
            for i, key in enumerate(keys):
                k = self._k_or_none(key)
                if k is not None and self._put_sessions.pop(k, None) is not None:
                    idx.append(i)
                    pool.append(k)
        if not idx:
            return out
        try:
            client = self._c()
            if commit:
                codes = client.batch_put_commit(pool)
            else:
                client.batch_put_abort(pool)
                codes = [ErrorCode.OK] * len(pool)
        except KVPoolError as exc:
            return [code_of(exc) if i in idx else INVALID for i in range(len(keys))]
        for i, c in zip(idx, codes, strict=True):
            out[i] = mooncake_code(c)
        return out

    def _end_sessions(self) -> None:
        """Abort open put sessions and drop get sessions (close())."""
        with self._sess_lock:
            pending = list(self._put_sessions)
            self._put_sessions.clear()
            self._get_sessions.clear()
        if pending and self._client is not None:
            try:
                self._client.batch_put_abort(pending)
            except KVPoolError as exc:
                log.debug("aborting %d put sessions: %s", len(pending), exc)


def _pick_groups(cfg: ReplicateConfig, idx: Sequence[int]) -> ReplicateConfig:
    """``cfg`` with ``group_ids`` filtered to the keys at ``idx`` (Mooncake
    filters them the same way when it skips keys)."""
    import dataclasses

    assert cfg.group_ids is not None
    return dataclasses.replace(cfg, group_ids=[cfg.group_ids[i] for i in idx])
