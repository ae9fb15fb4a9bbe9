"""``BufferPool``: Mooncake's scratch-buffer leases, on kvpool.

Mooncake leases scratch memory for zero-copy calls out of its setup-time
local buffer. kvpool has no such buffer (it copies straight into caller
memory), so the pool keeps its own registered host buffers, in power-of-two
size classes, reused across leases; ``max_bytes`` bounds the bytes leased at
once (0: twice the store's ``local_buffer_size``, Mooncake's default of one
overflow burst). Same constructor, ``acquire``/``buffer``/``prewarm``/
``close`` and lease API (``ptr``, ``size``, ``buffer``, ``release``, context
manager) as Mooncake's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

__all__ = [
    "BufferLease",
    "BufferLeaseView",
    "BufferPool",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "RegisteredBufferPool",
]


class BufferLeaseView:
    """The ``memoryview`` of a lease's requested bytes (``.buffer``)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    @property
    def buffer(self) -> memoryview:
        return self._view


class BufferLease:
    """Scratch memory from a :class:`BufferPool`: ``ptr`` (registered with
    the store), ``size`` (the requested size) and ``buffer`` (a memoryview of
    it). ``release()`` returns it; do not use ``ptr`` or views afterwards."""

    def __init__(self, pool: BufferPool, array: np.ndarray, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._array = array
        self._size = size
        self._view = array.data[:size]

    @property
    def ptr(self) -> int:
        return int(self._array.ctypes.data)

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        return self._view

    def release(self) -> None:
        """Give the memory back to the pool. Raises RuntimeError while views
        exported from :attr:`buffer` are alive (delete them first)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            self._view.release()
        except BufferError as exc:
            self._pool = pool
            raise RuntimeError("lease buffer still has exported views") from exc
        pool._give_back(self._array)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BufferPool:
    """Leases of registered scratch buffers (module docstring)."""

    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 65536,
                 max_size_class: int | None = None, alignment: int = 8388608,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        if min_size_class <= 0 or alignment <= 0:
            raise ValueError("min_size_class and alignment must be > 0")
        self._store = store
        local = int(getattr(store, "_local_buffer_size", 16 << 20))
        self._max_bytes = int(max_bytes) or 2 * max(local, min_size_class)
        self._min = int(min_size_class)
        self._max_class = int(max_size_class) if max_size_class else None
        self._block = bool(block_on_exhaustion)
        self._timeout = default_timeout
        self._max_regions = max_regions
        self._cv = threading.Condition()
        self._free: dict[int, list[np.ndarray]] = {}
        self._leased_bytes = 0
        self._leases = 0
        self._closed = False
        if prewarm_size and prewarm_count:
            self.prewarm(int(prewarm_size), int(prewarm_count))

    def _size_class(self, size: int) -> int:
        cls = self._min
        while cls < size:
            cls <<= 1
        if self._max_class is not None and cls > self._max_class:
            cls = max(size, self._max_class)
        return cls

    def _new(self, cls: int) -> np.ndarray:
        arr = np.empty(cls, dtype=np.uint8)
        rc = self._store.register_buffer(int(arr.ctypes.data), cls)
        if rc != 0:
            raise RuntimeError(f"register_buffer failed ({rc})")
        return arr

    def prewarm(self, size: int, count: int) -> None:
        """Create ``count`` buffers of ``size``'s class ahead of use."""
        cls = self._size_class(int(size))
        made = [self._new(cls) for _ in range(int(count))]
        with self._cv:
            self._free.setdefault(cls, []).extend(made)

    def acquire(self, size: int, block: bool | None = None,
                timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes. Waits for leased bytes to come back when
        the pool is exhausted (``block``, default ``block_on_exhaustion``; at
        most ``timeout`` s, default ``default_timeout``), else RuntimeError."""
        if size <= 0:
            raise ValueError("size must be > 0")
        cls = self._size_class(int(size))
        block = self._block if block is None else bool(block)
        wait = self._timeout if timeout is None else timeout
        deadline = None if wait is None else time.monotonic() + float(wait)
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("BufferPool is closed")
                room = self._leased_bytes + cls <= self._max_bytes
                regions_ok = self._max_regions is None or self._leases < self._max_regions
                if room and regions_ok:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    raise RuntimeError(f"BufferPool exhausted ({self._leased_bytes} of "
                                       f"{self._max_bytes} bytes leased)")
                self._cv.wait(left)
            self._leased_bytes += cls
            self._leases += 1
            free = self._free.get(cls)
            arr = free.pop() if free else None
        if arr is None:
            try:
                arr = self._new(cls)
            except BaseException:
                with self._cv:
                    self._leased_bytes -= cls
                    self._leases -= 1
                    self._cv.notify_all()
                raise
        return BufferLease(self, arr, int(size))

    def buffer(self, size: int, block: bool | None = None,
               timeout: float | None = None) -> BufferLease:
        """:meth:`acquire`, for ``with pool.buffer(n) as lease:``."""
        return self.acquire(size, block, timeout)

    def _give_back(self, arr: np.ndarray) -> None:
        with self._cv:
            self._leased_bytes -= arr.size
            self._leases -= 1
            self._free.setdefault(arr.size, []).append(arr)
            self._cv.notify_all()

    def close(self) -> None:
        """Unregister every buffer. RuntimeError while leases are active."""
        with self._cv:
            if self._leases:
                raise RuntimeError(f"{self._leases} leases are still active")
            self._closed = True
            arrays = [a for lst in self._free.values() for a in lst]
            self._free.clear()
        for arr in arrays:
            self._store.unregister_buffer(int(arr.ctypes.data))


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView
