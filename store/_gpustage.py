"""Device staging for multi-part GPU values: one gather (puts) or scatter (gets) per call.

A Mooncake multi-buffer call names many small GPU regions per key (vLLM: one
per layer and K/V of a block). Moved one transfer request each, every part
pays a request's bookkeeping and a synchronous copy of its own; staged, the
call copies every part into (or out of) one device buffer with a few
asynchronous device-to-device copies, synchronises once, and the transfer
moves one contiguous range per key, like a single-buffer call.

:func:`plan_copies` turns the per-part copies into few ``cudaMemcpy2DAsync``
rows: parts that continue each other merge, and the same part of consecutive
keys (a fixed distance apart in the caller's memory and in the staging
buffer) becomes one 2-D copy. :class:`DeviceStaging` keeps the device
buffers (per device, reused across calls, at most ``max_bytes`` each).

Stream order is that of a plain transfer: the copies run on the legacy
default stream (after the caller's kernels there), or on the thread's
non-blocking stream inside :func:`kvpool.transfer.gpu.independent_copies`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.core.errors import KVPoolError
from kvpool.transfer.gpu import LEGACY_STREAM, CudaRuntime, copies_independent

__all__ = ["STAGING_MAX_BYTES", "Copy2D", "DeviceStaging", "gpu_regions", "plan_copies",
           "run_copies"]

log = logging.getLogger(__name__)

STAGING_MAX_BYTES = 1 << 30  # one call stages at most this much per device
_MAX_PITCH = (1 << 31) - 1  # cudaMemcpy2D's pitch limit on current GPUs
_ALIGN = 1 << 20


@dataclass(frozen=True, slots=True)
class Copy2D:
    """``height`` rows of ``width`` bytes from ``src`` (rows ``spitch`` apart)
    to ``dst`` (rows ``dpitch`` apart); ``height`` 1 is a plain copy."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def _merge_runs(copies: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join consecutive ``(dst, src, n)`` copies that continue each other."""
    out: list[tuple[int, int, int]] = []
    for dst, src, n in copies:
        if n <= 0:
            continue
        if out:
            d0, s0, n0 = out[-1]
            if d0 + n0 == dst and s0 + n0 == src:
                out[-1] = (d0, s0, n0 + n)
                continue
        out.append((dst, src, n))
    return out


def plan_copies(per_key: Sequence[Sequence[tuple[int, int, int]]]) -> list[Copy2D]:
    """Copies ``(dst, src, n)`` grouped per key (in key order) as few 2-D copies.

    Within a key, parts that continue each other are merged. Then the j-th
    part of consecutive keys joins one 2-D copy while its width and the
    distances between the keys' destinations and sources stay the same
    (both at least the width, below the pitch limit). Every byte is copied
    exactly once; the order of the copies is irrelevant (the destinations of
    a call do not overlap)."""
    merged = [_merge_runs(parts) for parts in per_key]
    out: list[Copy2D] = []
    depth = max((len(m) for m in merged), default=0)
    for j in range(depth):
        run: list[tuple[int, int, int]] = []
        for m in merged:
            if j >= len(m):
                out.extend(_flush(run))
                run = []
                continue
            c = m[j]
            if run and not _extends(run, c):
                out.extend(_flush(run))
                run = []
            run.append(c)
        out.extend(_flush(run))
    return out


def _extends(run: list[tuple[int, int, int]], c: tuple[int, int, int]) -> bool:
    last = run[-1]
    if c[2] != last[2]:
        return False
    dd, ds = c[0] - last[0], c[1] - last[1]
    if not (last[2] <= dd <= _MAX_PITCH and last[2] <= ds <= _MAX_PITCH):
        return False
    if len(run) == 1:
        return True
    return dd == last[0] - run[-2][0] and ds == last[1] - run[-2][1]


def _flush(run: list[tuple[int, int, int]]) -> list[Copy2D]:
    if not run:
        return []
    dst, src, n = run[0]
    if len(run) == 1:
        return [Copy2D(dst, n, src, n, n, 1)]
    return [Copy2D(dst, run[1][0] - dst, src, run[1][1] - src, n, len(run))]


def run_copies(rt: CudaRuntime, plan: Sequence[Copy2D], device: int) -> None:
    """Run ``plan`` on ``device`` and wait for it (module docstring: which stream)."""
    if not plan:
        return
    if copies_independent():
        stream = rt.side_stream(device)
    else:
        stream = LEGACY_STREAM
    rt.set_device(device)
    for c in plan:
        if c.height == 1:
            rt.memcpy_async(c.dst, c.src, c.width, stream)
        else:
            rt.memcpy2d_async(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, stream)
    rt.stream_synchronize(stream)


class DeviceStaging:
    """Device buffers for staging, per device; a call takes one and gives it
    back. Thread-safe; buffers grow to a call's need up to ``max_bytes``."""

    def __init__(self, rt: CudaRuntime, max_bytes: int = STAGING_MAX_BYTES) -> None:
        self.rt = rt
        self.max_bytes = max_bytes
        self._free: dict[int, list[tuple[int, int]]] = {}  # device -> [(ptr, size)]
        self._lock = threading.Lock()
        self._closed = False

    def take(self, device: int, nbytes: int) -> tuple[int, int] | None:
        """A buffer ``(ptr, size)`` of at least ``nbytes`` on ``device``, or None
        (more than ``max_bytes``, or no device memory)."""
        if nbytes > self.max_bytes or nbytes <= 0:
            return None
        small: tuple[int, int] | None = None
        with self._lock:
            if self._closed:
                return None
            free = self._free.setdefault(device, [])
            for i, (_ptr, size) in enumerate(free):
                if size >= nbytes:
                    return free.pop(i)
            if free:
                small = free.pop()
        try:
            if small is not None:
                self.rt.set_device(device)
                self.rt.free(small[0])
            size = min(self.max_bytes, -(-nbytes // _ALIGN) * _ALIGN)
            return self.rt.malloc(size, device), size
        except Exception as exc:  # out of device memory: the caller goes part by part
            log.debug("device staging of %d bytes failed: %s", nbytes, exc)
            return None

    def give(self, device: int, buf: tuple[int, int]) -> None:
        """Return a buffer from :meth:`take` (its copies are complete)."""
        with self._lock:
            if not self._closed and len(self._free.setdefault(device, [])) < 2:
                self._free[device].append(buf)
                return
        self._release(device, buf)

    def _release(self, device: int, buf: tuple[int, int]) -> None:
        try:
            self.rt.set_device(device)
            self.rt.free(buf[0])
        except Exception as exc:
            log.debug("freeing device staging: %s", exc)

    def close(self) -> None:
        """Free the kept buffers (buffers still taken are freed when given back)."""
        with self._lock:
            self._closed = True
            kept, self._free = self._free, {}
        for device, bufs in kept.items():
            for buf in bufs:
                self._release(device, buf)


def gpu_regions(parts: Sequence[Any]) -> tuple[int, list[tuple[int, int]]] | None:
    """``(device, [(address, bytes)])`` when every part is GPU memory of one
    device (BufferHandles, CUDA tensors, ``__cuda_array_interface__``
    objects), else None."""
    from kvpool.store._bufutil import is_gpu_buffer
    from kvpool.transfer.buffers import BufferHandle, as_buffer

    device = -1
    out: list[tuple[int, int]] = []
    for p in parts:
        if type(p) is BufferHandle:
            h = p
        elif is_gpu_buffer(p):
            try:
                h = as_buffer(p)
            except KVPoolError:  # e.g. not contiguous: the transfer reports it
                return None
        else:
            return None
        if not h.is_gpu or (device >= 0 and h.device_index != device):
            return None
        device = h.device_index
        out.append((h.ptr, h.length))
    return (device, out) if device >= 0 else None
