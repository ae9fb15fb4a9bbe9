"""Mooncake's session calls: ranges of objects read and written with no master RPC.

- ``batch_get_session_start`` locates objects once (one master RPC, a read
  lease each); ``batch_get_into_multi_buffer_ranges`` then reads byte ranges
  of them with no RPC, until the lease ends (-707) or the session does;
- ``batch_put_session_start`` reserves objects (one RPC, no data); ranges
  are written into them with no RPC; ``batch_put_session_end`` commits
  (they become readable), ``batch_put_session_revoke`` aborts.

Results are Mooncake's: per key 0, the bytes moved, or a negative code
(-600 without a session, for a range outside the object, or for lists of
different lengths).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store.client import Location, RangeRead, RangeWrite, Reservation
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_codes import INVALID, TRANSFER_FAIL, code_of, log, mooncake_code
from kvpool.store.mooncake_core import MooncakeCore, pick_groups
from kvpool.store.mooncake_memory import CallerMemory

__all__ = ["SessionCalls"]

S = TypeVar("S", Location, Reservation)  # a get or a put session
J = TypeVar("J", RangeRead, RangeWrite)  # a range of one


class SessionCalls:
    """The get and put sessions of one store (module docstring)."""

    def __init__(self, core: MooncakeCore, memory: CallerMemory) -> None:
        self._core = core
        self._memory = memory
        self._gets: dict[str, Location] = {}
        self._puts: dict[str, Reservation] = {}
        self._lock = threading.Lock()

    def _jobs(self, keys: Sequence[str], sessions: dict[str, S],
              all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]],
              all_offsets: Sequence[Sequence[int]],
              job: Callable[[S, Any, int, int], J]) -> tuple[list[int], list[J], list[int]]:
        """Per key 0 when it has a session in ``sessions`` and ranges of matching
        lengths (else INVALID_PARAMS); ``job(session, buffer, object offset,
        size)`` of each of their ranges; the key index of each job. Raises
        KVPoolError for caller memory that cannot be used."""
        out = [INVALID] * len(keys)
        jobs: list[J] = []
        owner: list[int] = []
        for i, key in enumerate(keys):
            ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_offsets[i]
            k = self._core.key_or_none(key)
            with self._lock:
                entry = sessions.get(k) if k is not None else None
            if entry is None or not (len(ptrs) == len(sizes) == len(offs)):
                continue
            out[i] = 0
            for p, s, o in zip(ptrs, sizes, offs, strict=True):
                jobs.append(job(entry, self._memory.slice(p, s), int(o), int(s)))
                owner.append(i)
        return out, jobs, owner

    # ------------------------------------------------------------------ get sessions

    def get_start(self, keys: Sequence[str]) -> list[int]:
        """Locate ``keys`` once (one master RPC; a read lease each). Per key 0
        or a Mooncake code (-704 missing)."""
        if not keys:
            return []
        try:
            pool_keys = self._core.keys(keys)
            locs = self._core.live().batch_locate(pool_keys)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        out: list[int] = []
        with self._lock:
            for k, loc in zip(pool_keys, locs, strict=True):
                if loc.code == ErrorCode.OK:
                    self._gets[k] = loc
                    out.append(0)
                else:
                    self._gets.pop(k, None)
                    out.append(mooncake_code(loc.code))
        return out

    def get_ranges(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                   all_sizes: Sequence[Sequence[int]],
                   all_src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Read ranges of session objects into buffers, no master RPC. Per key
        the bytes read, or a Mooncake code (-600 no session or bad range, -707
        the session's read lease ended)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets)):
            return [INVALID] * len(keys)
        try:
            out, reads, owner = self._jobs(keys, self._gets, all_buffer_ptrs, all_sizes,
                                           all_src_offsets, RangeRead)
            got = self._core.live().read_ranges(reads) if reads else []
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, r in zip(owner, got, strict=True):
            if out[i] >= 0:
                out[i] = out[i] + r if r >= 0 else mooncake_code(r)
        return out

    def get_end(self, keys: Sequence[str]) -> int:
        """Drop the get sessions of ``keys`` (their leases simply run out). 0."""
        with self._lock:
            for key in keys:
                k = self._core.key_or_none(key)
                if k is not None:
                    self._gets.pop(k, None)
        return 0

    # ------------------------------------------------------------------ put sessions

    def put_start(self, keys: Sequence[str], sizes: Sequence[int],
                  config: ReplicateConfig | None) -> list[int]:
        """Reserve ``sizes[i]`` bytes for each key (one master RPC, no data).
        Per key 0 or a Mooncake code: -705 exists, -600 a session is already
        open or a bad size."""
        if len(keys) != len(sizes):
            return [INVALID] * len(keys)
        out = [INVALID] * len(keys)
        try:
            client = self._core.live()
            cfg = self._core.config(config, len(keys))
            pool_keys = self._core.keys(keys)
            with self._lock:
                idx = [i for i, k in enumerate(pool_keys) if k not in self._puts]
            held = client.batch_put_reserve([pool_keys[i] for i in idx],
                                            [int(sizes[i]) for i in idx], pick_groups(cfg, idx))
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        with self._lock:
            for i, rv in zip(idx, held, strict=True):
                if rv.code == ErrorCode.OK:
                    self._puts[pool_keys[i]] = rv
                    out[i] = 0
                else:
                    out[i] = mooncake_code(rv.code)
        return out

    def put_ranges(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                   all_sizes: Sequence[Sequence[int]],
                   all_dst_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Write buffers into ranges of session objects, no master RPC. Per key
        the bytes written, or a Mooncake code (-600 no session or a range
        outside the object)."""
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets)):
            return [INVALID] * len(keys)
        try:
            out, writes, owner = self._jobs(
                keys, self._puts, all_buffer_ptrs, all_sizes, all_dst_offsets,
                lambda rv, buf, off, size: RangeWrite(buf, rv.replicas, off, size, rv.caps))
            done = self._core.live().write_ranges(writes) if writes else []
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        for i, w in zip(owner, writes, strict=True):
            out[i] += w.nbytes()
        for i, (ok, err) in zip(owner, done, strict=True):
            if not ok and out[i] >= 0:
                log.debug("range write of %r failed: %s", keys[i], err)
                out[i] = INVALID if "outside" in err else TRANSFER_FAIL
        return out

    def put_finish(self, keys: Sequence[str], commit: bool) -> list[int]:
        """Commit (or abort) put sessions. Per key 0 or a Mooncake code (-600
        no session)."""
        out = [INVALID] * len(keys)
        idx: list[int] = []
        pool: list[str] = []
        with self._lock:
            for i, key in enumerate(keys):
                k = self._core.key_or_none(key)
                if k is not None and self._puts.pop(k, None) is not None:
                    idx.append(i)
                    pool.append(k)
        if not idx:
            return out
        try:
            client = self._core.live()
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

    def end_all(self) -> None:
        """Forget every session (the store closes: the master revokes an open
        put session's reservation once its write window has passed)."""
        with self._lock:
            self._puts.clear()
            self._gets.clear()
