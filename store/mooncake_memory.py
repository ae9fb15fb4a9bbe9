"""Caller memory of Mooncake's zero-copy calls: registered regions and pointer views.

Mooncake's zero-copy calls take raw addresses (host or GPU) and sizes.
``register_buffer(ptr, size)`` regions are registered with the kvpool client
(a registered handle moves without per-call setup); every pointer a call
receives is looked up among them, and unregistered host memory works too
(except in ``get_into_ranges``, Mooncake's rule). A GPU address is never
passed on as host memory.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

from kvpool.core.errors import KVPoolError
from kvpool.store._gpuptr import pointer_is_device
from kvpool.store.mooncake_codes import INVALID, code_of
from kvpool.store.mooncake_core import MooncakeCore
from kvpool.transfer.buffers import BufferHandle

__all__ = ["CallerMemory"]


class CallerMemory:
    """The registered regions of one store and views of caller addresses."""

    def __init__(self, core: MooncakeCore) -> None:
        self._core = core
        # registered regions: sorted start addresses -> (end, handle)
        self._starts: list[int] = []
        self._regions: dict[int, tuple[int, Any]] = {}
        self._lock = threading.Lock()

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` (host or GPU); registering
        an address again replaces its region. 0 or a Mooncake code."""
        start, size = int(buffer_ptr), int(size)
        try:
            client = self._core.live()
            handle = client.register_buffer(
                (start, size), device="cuda" if pointer_is_device(start) else None)
        except KVPoolError as exc:
            return code_of(exc)
        with self._lock:
            old = self._regions.get(start)
            if old is None:
                bisect.insort(self._starts, start)
            self._regions[start] = (start + size, handle)
        try:
            if old is not None:
                client.unregister_buffer(old[1])
        except KVPoolError as exc:
            return code_of(exc)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Release a registered region: 0, INVALID_PARAMS for an unknown
        address, or a Mooncake code."""
        start = int(buffer_ptr)
        try:
            client = self._core.live()
            with self._lock:
                entry = self._regions.pop(start, None)
                if entry is None:
                    return INVALID
                self._starts.remove(start)
            client.unregister_buffer(entry[1])
        except KVPoolError as exc:
            return code_of(exc)
        return 0

    def forget(self) -> None:
        """Drop every registration (the client that held them is closing)."""
        with self._lock:
            self._regions.clear()
            self._starts.clear()

    def registered(self, ptr: int, size: int) -> tuple[Any, int] | None:
        """The registration covering ``[ptr, ptr+size)`` and the offset into it."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i >= 0:
                start = self._starts[i]
                end, handle = self._regions[start]
                if ptr + size <= end:
                    return handle, ptr - start
        return None

    def slice(self, ptr: int, size: int) -> Any:
        """A buffer for the caller memory ``[ptr, ptr+size)``: the registered
        handle when it is exactly that region, a numpy view of a registered
        host region, else a host or GPU view of the address range."""
        ptr, size = int(ptr), int(size)
        return _view(ptr, size, self.registered(ptr, size))

    def slicer(self) -> Callable[[int, int], Any]:
        """:meth:`slice` for the many pointers of one call: remembers the last
        registered region it hit (a call's pointers mostly share a few)."""
        last: list[Any] = [0, -1, None]  # start, end, handle

        def slice_(ptr: int, size: int) -> Any:
            ptr, size = int(ptr), int(size)
            if last[0] <= ptr and ptr + size <= last[1]:
                return _view(ptr, size, (last[2], ptr - last[0]))
            hit = self.registered(ptr, size)
            if hit is not None:
                start = ptr - hit[1]
                last[:] = [start, start + hit[0].length, hit[0]]
            return _view(ptr, size, hit)

        return slice_


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
