"""State and conventions shared by every part of the Mooncake-compatible store.

``MooncakeDistributedStore`` (store/mooncake.py) is assembled from mixins,
one per family of calls (zero-copy, tensors, administration); they all rest
on :class:`MooncakeCore`:

- the kvpool :class:`~kvpool.store.client.Client` behind the store, and what
  a call on a store that is not set up returns (``INVALID_PARAMS``, as
  Mooncake's "client is not initialized");
- return codes: Mooncake's integers. kvpool-only codes (below -1000, which
  Mooncake uses for other things) become the nearest Mooncake code and the
  original is logged at DEBUG;
- ``tenant_id``: a namespace for keys. A non-default tenant's keys are
  stored as ``"\\x1f<tenant>\\x1f<key>"``; no caller key may start with
  ``\\x1f``, so tenants never see each other's keys;
- ``local_buffer_size``: Mooncake stages every non-zero-copy call (bytes
  put/get, parts, buffers, tensors) through a buffer of this size, and a call
  that needs more fails. kvpool copies straight between the caller's memory
  and the pool, but keeps that limit per call so programs behave the same;
- registered buffers: ``register_buffer(ptr, size)`` regions, looked up for
  every pointer a zero-copy call receives.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.config import parse_size
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store._bufutil import buffer_nbytes
from kvpool.store._gpuptr import pointer_is_device
from kvpool.store.client import Client
from kvpool.store.config import ReplicateConfig
from kvpool.transfer.buffers import BufferHandle

__all__ = [
    "DEFAULT_TENANT",
    "INVALID",
    "NOT_SUPPORTED",
    "TENANT_SEP",
    "MooncakeCore",
    "code_of",
    "mooncake_code",
    "mooncake_size",
]

log = logging.getLogger("kvpool.store.mooncake")

DEFAULT_TENANT = "default"
TENANT_SEP = "\x1f"
INVALID = int(ErrorCode.INVALID_PARAMS)
NOT_SUPPORTED = int(ErrorCode.NOT_SUPPORTED)

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
}


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
    return int(ErrorCode.INTERNAL_ERROR)


def mooncake_size(value: Any) -> int:
    """A size as Mooncake's setup reads it: an int, or a string whose units
    (K/KB, M/MB, G/GB, T/TB, and kvpool's KiB, MiB, ...) are all powers of 1024
    (:func:`~kvpool.core.config.parse_size` with ``binary_units``).
    Raises KVPoolError(INVALID_PARAMS)."""
    try:
        return parse_size(value, binary_units=True)
    except KVPoolError:
        raise KVPoolError(f"not a size: {value!r}", ErrorCode.INVALID_PARAMS) from None


class NotSetUp(KVPoolError):
    """A call on a store that is not set up (or was closed)."""

    code = ErrorCode.INVALID_PARAMS


class MooncakeCore:
    """State and helpers the Mooncake-compatible mixins share (module docstring)."""

    def __init__(self) -> None:
        self._client: Client | None = None
        self._hostname = ""
        self._tenant = DEFAULT_TENANT
        self._prefix = ""
        self._local_buffer_size = 16 << 20
        # registered regions: sorted start addresses -> (end, handle)
        self._reg_starts: list[int] = []
        self._reg: dict[int, tuple[int, Any]] = {}
        self._reg_lock = threading.Lock()

    # ------------------------------------------------------------------ client, keys

    def _c(self) -> Client:
        client = self._client
        if client is None:
            raise NotSetUp("store is not set up (call setup() first)")
        return client

    def _set_tenant(self, tenant_id: str) -> None:
        tenant = str(tenant_id).strip() or DEFAULT_TENANT
        if TENANT_SEP in tenant:
            raise KVPoolError("tenant_id must not contain \\x1f", ErrorCode.INVALID_PARAMS)
        self._tenant = tenant
        self._prefix = "" if tenant == DEFAULT_TENANT else f"{TENANT_SEP}{tenant}{TENANT_SEP}"

    def _k(self, key: str) -> str:
        """The pool key of caller key ``key`` (tenant namespace applied)."""
        if not isinstance(key, str):
            raise TypeError(f"key must be str, got {type(key).__name__}")
        if not key or key.startswith(TENANT_SEP):
            raise KVPoolError(f"invalid key {key!r}", ErrorCode.INVALID_PARAMS)
        return self._prefix + key if self._prefix else key

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [self._k(k) for k in keys]

    def _k_or_none(self, key: str) -> str | None:
        """:meth:`_k`, or None for a key Mooncake treats as absent (empty...)."""
        try:
            return self._k(key)
        except KVPoolError:
            return None

    def _fits_staging(self, nbytes: int) -> bool:
        """Whether a non-zero-copy call of ``nbytes`` fits Mooncake's staging
        buffer (``local_buffer_size``; module docstring)."""
        if nbytes <= self._local_buffer_size:
            return True
        log.error("%d bytes do not fit local_buffer_size (%d); use the zero-copy calls "
                  "or a larger local_buffer_size", nbytes, self._local_buffer_size)
        return False

    # ------------------------------------------------------------------ upsert

    def _upsert_many(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                     config: ReplicateConfig | None, staged: bool = True) -> list[int]:
        """Insert-or-replace each key with the concatenation of its parts: one
        BATCH_UPSERT_START, one transfer batch, one BATCH_PUT_END. Per key 0 or
        a Mooncake code. ``staged``: a non-zero-copy call (``local_buffer_size``
        applies).

        A replaced object stays readable, unchanged, until the new one is
        committed (readers never see the key missing); its space is freed
        once the read leases on it have ended. Its hard pin carries over; its
        soft pin too unless the config says ENABLE (a new pin) or DISABLE; its
        object group cannot change (-600 for another ``group_ids`` entry). A
        key given twice in one call ends with its last value.
        """
        try:
            cfg = self._config(config, len(keys))
            client = self._c()
            pool_keys = self._ks(keys)
            if staged and not self._fits_staging(
                    sum(buffer_nbytes(p) for ps in parts for p in ps)):
                return [INVALID] * len(keys)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        results = [INVALID] * len(keys)
        todo = list(range(len(keys)))
        while todo:
            round_cfg = cfg
            if cfg is not None and cfg.group_ids is not None and len(todo) != len(keys):
                round_cfg = dataclasses.replace(cfg, group_ids=[cfg.group_ids[i] for i in todo])
            try:
                if all(len(parts[i]) == 1 for i in todo):  # one buffer each: the direct path
                    codes = client.batch_put_from([pool_keys[i] for i in todo],
                                                  [parts[i][0] for i in todo], round_cfg,
                                                  upsert=True)
                else:
                    codes = client.batch_put_parts([pool_keys[i] for i in todo],
                                                   [parts[i] for i in todo], round_cfg,
                                                   upsert=True)
            except KVPoolError as exc:
                for i in todo:
                    results[i] = code_of(exc)
                break
            again: list[int] = []
            for i, c in zip(todo, codes, strict=True):
                # only a key repeated in the batch is refused as existing: its
                # later occurrences go in the next round (the last value wins)
                if c == ErrorCode.OBJECT_ALREADY_EXISTS:
                    again.append(i)
                else:
                    results[i] = mooncake_code(c)
            todo = again
        return results

    # ------------------------------------------------------------------ configs

    def _config(self, config: ReplicateConfig | None, keys: int = 1) -> ReplicateConfig | None:
        """Check a write's ReplicateConfig the way Mooncake does and apply what
        kvpool maps onto its own placement. Raises KVPoolError."""
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
        if config.prefer_alloc_in_same_node and self._client is not None:
            own = self._client.segment_ids
            if own and own[0] not in config.segments():
                config = dataclasses.replace(
                    config, preferred_segments=[own[0], *config.preferred_segments])
        return config

    # ------------------------------------------------------------------ registered buffers

    def _register(self, ptr: int, size: int) -> None:
        start, size = int(ptr), int(size)
        device = "cuda" if pointer_is_device(start) else None
        handle = self._c().register_buffer((start, size), device=device)
        with self._reg_lock:
            old = self._reg.get(start)
            if old is None:
                bisect.insort(self._reg_starts, start)
            self._reg[start] = (start + size, handle)
        if old is not None:
            self._c().unregister_buffer(old[1])

    def _unregister(self, ptr: int) -> bool:
        start = int(ptr)
        with self._reg_lock:
            entry = self._reg.pop(start, None)
            if entry is None:
                return False
            self._reg_starts.remove(start)
        self._c().unregister_buffer(entry[1])
        return True

    def _forget_registrations(self) -> None:
        with self._reg_lock:
            self._reg.clear()
            self._reg_starts.clear()

    def _registered(self, ptr: int, size: int) -> tuple[Any, int] | None:
        """The registration covering ``[ptr, ptr+size)`` and the offset into it."""
        with self._reg_lock:
            i = bisect.bisect_right(self._reg_starts, ptr) - 1
            if i >= 0:
                start = self._reg_starts[i]
                end, handle = self._reg[start]
                if ptr + size <= end:
                    return handle, ptr - start
        return None

    def _slice(self, ptr: int, size: int) -> Any:
        """A buffer for the caller memory ``[ptr, ptr+size)``: the registered
        handle when it is exactly that region, a numpy view of a registered
        host region, else a host or GPU view of the address range (never a GPU
        address passed on as host memory)."""
        ptr, size = int(ptr), int(size)
        return self._view(ptr, size, self._registered(ptr, size))

    def _slicer(self) -> Callable[[int, int], Any]:
        """:meth:`_slice` for the many pointers of one call: remembers the last
        registered region it hit (a call's pointers mostly share a few)."""
        last: list[Any] = [0, -1, None]  # start, end, handle

        def slice_(ptr: int, size: int) -> Any:
            ptr, size = int(ptr), int(size)
            if last[0] <= ptr and ptr + size <= last[1]:
                return self._view(ptr, size, (last[2], ptr - last[0]))
            hit = self._registered(ptr, size)
            if hit is not None:
                start = ptr - hit[1]
                last[:] = [start, start + hit[0].length, hit[0]]
            return self._view(ptr, size, hit)

        return slice_

    @staticmethod
    def _view(ptr: int, size: int, hit: tuple[Any, int] | None) -> Any:
        if hit is not None:
            handle, off = hit
            if off == 0 and handle.length == size:
                return handle
            if not getattr(handle, "is_gpu", False):
                arr = getattr(handle, "array", None)
                # a numpy view of the registered memory costs far less per
                # request than wrapping the raw address again
                return arr[off:off + size] if arr is not None else (ptr, size)
            # a view of a registered GPU region: a handle made directly (the
            # multi-buffer calls make one per part)
            return BufferHandle(ptr=ptr, length=size, device="cuda",
                                device_index=handle.device_index)
        elif not pointer_is_device(ptr):
            return (ptr, size)
        from kvpool.transfer import as_buffer

        return as_buffer((ptr, size), device="cuda")
