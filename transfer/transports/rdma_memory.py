"""Memory registration of the ``rdma`` transport: what the HCA may touch.

The owner registers each memory segment once (access from the segment's
allowed ops) and re-registers it when the segment object changes. Caller
buffers marked registered (``register_buffer``) are registered once and
reused (GPU memory only where a peer-memory client makes ``ibv_reg_mr`` on
device pointers work); their MRs go when the engine unregisters the buffer
or the buffer is gone. Every other buffer is staged through a pool of
pre-registered host buffers (:class:`Staging`), GPU buffers with a CUDA copy.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.config import TransportSettings
from kvpool.transfer.rdma_verbs import Access, MemoryRegion, VerbsDevice, VerbsError
from kvpool.transfer.segment import LocalSegment
from kvpool.transfer.transports.base import WorkItem
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["RdmaMemory", "Staging"]

log = logging.getLogger(__name__)

_MR_KEY = "rdma_mr"


class Staging:
    """``count`` pre-registered host buffers of ``size`` bytes (one MR)."""

    def __init__(self, dev: VerbsDevice, count: int, size: int) -> None:
        self.size = size
        self.buf = np.zeros(count * size, dtype=np.uint8)
        self.mr = dev.reg_mr(int(self.buf.ctypes.data), self.buf.nbytes,
                             Access.LOCAL_WRITE)
        self._free = list(range(count))
        self._lock = threading.Lock()
        self.cuda_registered = False

    def try_acquire(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, i: int) -> None:
        with self._lock:
            self._free.append(i)

    def addr(self, i: int) -> int:
        return self.mr.addr + i * self.size

    def view(self, i: int, n: int) -> np.ndarray:
        return self.buf[i * self.size:i * self.size + n]

    def close(self) -> None:
        self.mr.close()


class RdmaMemory:
    """The MRs of one transport: segments it owns, caller buffers, staging.

    ``device()`` returns the open device (raises where none is); ``owner``
    tells this transport's MRs apart in a buffer's cache; ``counters`` is the
    transport's (``staged_bytes`` is counted here); ``cuda`` returns (CUDA
    runtime | None, reason) for staging GPU buffers.
    """

    def __init__(self, device: Callable[[], VerbsDevice], settings: TransportSettings,
                 counters: dict[str, int], cuda: Callable[[], tuple[Any, str]],
                 owner: int) -> None:
        self._device = device
        self._settings = settings
        self._counters = counters
        self._cuda_runtime = cuda
        self._key = f"{_MR_KEY}:{owner}"
        self._lock = threading.Lock()
        self._segments: dict[str, tuple[LocalSegment, MemoryRegion]] = {}
        #: id(handle) -> (weak handle, MR); swept when the handle is unregistered or gone
        self.buffers: dict[int, tuple[weakref.ref[BufferHandle], MemoryRegion]] = {}
        self._staging: Staging | None = None

    # -- segments this process owns ---------------------------------------------------
    def segment_mr(self, seg: LocalSegment) -> MemoryRegion:
        """The MR of a memory segment owned here (registered on first use)."""
        with self._lock:
            cached = self._segments.get(seg.segment_id)
            if cached is not None and cached[0] is seg:
                return cached[1]
            view = seg.view()
            if view is None:
                raise TransferError(f"segment {seg.segment_id!r} is not memory-mapped",
                                    ErrorCode.INVALID_PARAMS, retryable=False)
            addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
            access = Access.LOCAL_WRITE
            if TransferOp.READ in seg.allowed_ops:
                access |= Access.REMOTE_READ
            if TransferOp.WRITE in seg.allowed_ops:
                access |= Access.REMOTE_WRITE
            try:
                mr = self._device().reg_mr(addr, seg.size, access)
            except VerbsError as exc:
                raise TransferError(f"register segment {seg.segment_id!r}: {exc}",
                                    ErrorCode.TRANSFER_FAIL) from exc
            if cached is not None:
                cached[1].close()
            self._segments[seg.segment_id] = (seg, mr)
            return mr

    def forget_segment(self, segment_id: str) -> None:
        """Deregister the segment if it is registered here (peers' later WRs fail)."""
        with self._lock:
            owned = self._segments.pop(segment_id, None)
        if owned is not None:
            owned[1].close()

    # -- caller buffers -------------------------------------------------------------------
    def register_buffer(self, handle: BufferHandle) -> bool:
        """Register a caller buffer once (host memory; GPU memory only where
        the driver accepts device pointers, e.g. nvidia-peermem). Returns
        whether it is registered; unregistered buffers are staged."""
        key = self._key
        if key in handle.cache:
            return handle.cache[key] is not None
        mr: MemoryRegion | None = None
        try:
            mr = self._device().reg_mr(handle.ptr, handle.length,
                                       Access.LOCAL_WRITE | Access.REMOTE_READ
                                       | Access.REMOTE_WRITE)
        except (VerbsError, TransferError) as exc:
            log.info("rdma: buffer of %d bytes (%s) not registrable, staging it: %s",
                     handle.length, handle.device, exc)
        handle.cache[key] = mr
        self.sweep()
        if mr is not None:
            with self._lock:
                self.buffers[id(handle)] = (weakref.ref(handle), mr)
        return mr is not None

    def sweep(self) -> None:
        """Deregister MRs of buffers the engine unregistered (``registered``
        cleared) or that no longer exist."""
        with self._lock:
            dead = [k for k, (ref, _) in self.buffers.items()
                    if (h := ref()) is None or not h.registered]
            mrs = [self.buffers.pop(k)[1] for k in dead]
        for mr in mrs:
            mr.close()

    def unregister_buffer(self, handle: BufferHandle) -> None:
        """Deregister a buffer registered by :meth:`register_buffer`."""
        mr = handle.cache.pop(self._key, None)
        with self._lock:
            self.buffers.pop(id(handle), None)
        if mr is not None:
            mr.close()
        self.sweep()

    def local_mr(self, handle: BufferHandle) -> MemoryRegion | None:
        """The MR of a registered buffer (None: the buffer is staged)."""
        if not handle.registered:
            return None
        key = self._key
        if key not in handle.cache:
            self.register_buffer(handle)
        mr = handle.cache.get(key)
        return mr if isinstance(mr, MemoryRegion) else None

    # -- staging --------------------------------------------------------------------------
    def staging(self) -> Staging:
        """The staging pool (registered on first use)."""
        with self._lock:
            if self._staging is None:
                try:
                    self._staging = Staging(self._device(), self._settings.staging_buffers,
                                            self._settings.staging_bytes)
                except VerbsError as exc:
                    raise TransferError(f"register staging buffers: {exc}",
                                        ErrorCode.TRANSFER_FAIL) from exc
            return self._staging

    def stage_in(self, item: WorkItem, offset: int, length: int, dst: np.ndarray) -> None:
        """Copy the request's ``length`` bytes at ``offset`` into a staging buffer."""
        start = item.buffer_offset + offset
        self._counters["staged_bytes"] += length
        if item.buffer.is_gpu:
            self._cuda().memcpy(int(dst.ctypes.data), item.buffer.ptr + start, length)
        else:
            dst[:] = item.buffer.host_view(start, length)

    def stage_out(self, item: WorkItem, offset: int, length: int, src: np.ndarray) -> None:
        """Copy a staging buffer into the request's bytes at ``offset``."""
        start = item.buffer_offset + offset
        self._counters["staged_bytes"] += length
        if item.buffer.is_gpu:
            self._cuda().memcpy(item.buffer.ptr + start, int(src.ctypes.data), length)
        else:
            item.buffer.host_view(start, length)[:] = src

    def _cuda(self) -> Any:
        rt, reason = self._cuda_runtime()
        if rt is None:
            raise TransferError(f"GPU buffer but {reason}", ErrorCode.TRANSPORT_UNAVAILABLE,
                                retryable=False)
        staging = self._staging
        if staging is not None and not staging.cuda_registered:
            try:  # page-lock for CUDA too so the copies are direct DMA
                rt.host_register(int(staging.buf.ctypes.data), staging.buf.nbytes)
                staging.cuda_registered = True
            except TransferError:
                log.debug("cudaHostRegister of the rdma staging pool failed", exc_info=True)
        return rt

    # -- lifecycle ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``registered_segments`` and ``registered_buffers``."""
        with self._lock:
            return {"registered_segments": len(self._segments),
                    "registered_buffers": len(self.buffers)}

    def close(self) -> None:
        """Deregister everything."""
        with self._lock:
            mrs = [mr for _, mr in self._segments.values()]
            mrs += [mr for _, mr in self.buffers.values()]
            self._segments.clear()
            self.buffers.clear()
            staging, self._staging = self._staging, None
        for mr in mrs:
            mr.close()
        if staging is not None:
            staging.close()
