"""``shm``: same-host memory segments, copied directly with no server hop.

A peer's segment (``/dev/shm/<descriptor.name>``) is mapped once and the
mapping cached until ``forget_segment`` (remove_peer_segment); a segment this
process owns is used in place. Host buffers are copied with numpy (memcpy,
GIL released). GPU buffers: the mapping is registered with CUDA once
(cudaHostRegister) so a copy is direct DMA between GPU and the segment; a
batch's GPU copies are queued back to back and waited for once (on the
legacy default stream, or on a non-blocking stream for batches submitted
inside :func:`kvpool.transfer.gpu.independent_copies`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.config import parse_size
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.copy import DEFAULT_SPLIT_MIN_BYTES, parallel_copyto
from kvpool.transfer.gpu import LEGACY_STREAM, CudaRuntime, cuda_runtime
from kvpool.transfer.segment import SHM_DIR, LocalSegment, MemorySegment, map_shm
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["ShmTransport"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Mapping:
    name: str
    mm: mmap.mmap | None
    array: np.ndarray  # the usable region
    cuda_registered: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)


class ShmTransport(Transport):
    """Direct copies into same-host shared-memory segments."""

    name = "shm"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()
        self.bytes_copied = 0
        opts = self.settings.options
        # large host copies are split across threads (see kvpool.transfer.copy)
        self._copy_threads = int(opts.get("copy_threads", 0))
        self._split_min = int(parse_size(opts.get("split_min_bytes", DEFAULT_SPLIT_MIN_BYTES)))

    def available(self) -> tuple[bool, str]:
        if not os.path.isdir(SHM_DIR):
            return False, f"{SHM_DIR} does not exist"
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        if kind != SegmentKind.MEMORY or not same_host:
            return False
        return device == "cpu" or cuda_runtime()[0] is not None

    # -- mappings ---------------------------------------------------------------
    def _region(self, item: WorkItem) -> _Mapping:
        return self._mapping(item.segment, item.local)

    def _mapping(self, seg: SegmentDescriptor, local: LocalSegment | None) -> _Mapping:
        if isinstance(local, MemorySegment):
            # owned by this process: in place; cache the CUDA registration state on it
            m = local.cache.get("shm_mapping")
            if not isinstance(m, _Mapping) or m.array.size != local.size:
                m = _Mapping(local.name, None, local.array())
                local.cache["shm_mapping"] = m
            return m
        if local is not None:
            raise TransferError(f"segment {seg.segment_id} is not a memory segment",
                                ErrorCode.INVALID_PARAMS, retryable=False)
        with self._lock:
            m = self._maps.get(seg.segment_id)
            if m is not None and m.name == seg.name and m.array.size == seg.size:
                return m
            if m is not None:
                self._drop(m)
            mm = map_shm(seg.name, seg.base_offset + seg.size)
            arr = np.frombuffer(mm, dtype=np.uint8, count=seg.size, offset=seg.base_offset)
            m = _Mapping(seg.name, mm, arr)
            self._maps[seg.segment_id] = m
            return m

    def _drop(self, m: _Mapping) -> None:
        with m.lock:  # waits for a registration in progress (GPU warm-up)
            rt = cuda_runtime()[0] if m.cuda_registered else None
            if rt is not None:
                try:
                    rt.host_unregister(m.address)
                except Exception:
                    log.debug("cudaHostUnregister failed", exc_info=True)
            m.cuda_registered = True  # never register a dropped mapping
            m.array = np.empty(0, np.uint8)
        if m.mm is not None:
            try:
                m.mm.close()
            except BufferError:
                pass  # a caller still holds a view; freed with it

    def forget_segment(self, segment_id: str) -> None:
        with self._lock:
            m = self._maps.pop(segment_id, None)
        if m is not None:
            self._drop(m)

    def _ensure_registered(self, m: _Mapping, rt: CudaRuntime, local: LocalSegment | None) -> None:
        """Page-lock mapping ``m`` with CUDA, once (``local``: the segment when
        this process owns it, which then unregisters it when it closes)."""
        owner = local if isinstance(local, MemorySegment) else None
        with m.lock:
            if m.cuda_registered:
                return
            try:
                rt.host_register(m.address, m.array.size)
                m.cuda_registered = True
                if owner is not None:
                    addr = m.address
                    owner.cache["cuda_unregister"] = lambda: rt.host_unregister(addr)
            except Exception as exc:
                # still correct, only slower (pageable copies)
                log.warning("cudaHostRegister of shm %s failed (%s); using pageable copies",
                            m.name, exc)
                m.cuda_registered = True  # do not retry on every request

    @staticmethod
    def _runtime() -> CudaRuntime:
        rt, reason = cuda_runtime()
        if rt is None:
            raise TransferError(reason, ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
        return rt

    def warm_gpu(self, segment: SegmentDescriptor, local: LocalSegment | None,
                 same_host: bool) -> None:
        """Map and page-lock a same-host memory segment now, so the first GPU copy
        into it does not pay for registering the whole mapping (tens of ms for
        a few hundred MiB)."""
        if segment.kind != SegmentKind.MEMORY or not same_host or self.closed:
            return
        rt = cuda_runtime()[0]
        if rt is None:
            return
        self._ensure_registered(self._mapping(segment, local), rt, local)

    # -- execute ----------------------------------------------------------------
    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        """Host items are copied one by one; GPU items are queued on their
        stream (the legacy default stream, or the thread's non-blocking one for
        independent batches) and reported after one synchronisation per
        stream, so a batch's DMAs run back to back."""
        # (device, stream) -> items and the mappings they copy from or to (kept
        # referenced until the copies are done: a referenced mapping is never unmapped)
        queued: dict[tuple[int, int], list[tuple[WorkItem, np.ndarray]]] = {}
        for item in items:
            if self.closed:
                report(item, TransferError("shm transport closed", ErrorCode.CLOSED))
                continue
            if time.monotonic() > deadline:
                report(item, TransferError("deadline passed", ErrorCode.TIMEOUT))
                continue
            try:
                if item.buffer.is_gpu:
                    where, region = self._queue_gpu(item)
                    queued.setdefault(where, []).append((item, region))
                    continue
                self._copy(item)
            except TransferError as exc:
                report(item, exc)
                continue
            except (OSError, ValueError) as exc:
                report(item, TransferError(f"shm copy failed: {exc}", ErrorCode.TRANSFER_FAIL))
                continue
            self.bytes_copied += item.length
            report(item, None)
        for (device, stream), done in queued.items():
            err: TransferError | None = None
            try:
                rt = cuda_runtime()[0]
                assert rt is not None  # _queue_gpu found it
                rt.set_device(device)
                rt.stream_synchronize(stream)
            except TransferError as exc:
                err = exc
            except Exception as exc:  # a backend's own error type
                err = TransferError(f"CUDA copy failed: {exc}", ErrorCode.TRANSFER_FAIL)
            for item, _region in done:
                if err is None:
                    self.bytes_copied += item.length
                report(item, err)

    def _checked_region(self, item: WorkItem) -> _Mapping:
        """The item's mapping, its range checked."""
        m = self._region(item)
        if item.offset + item.length > m.array.size:
            raise TransferError("range outside mapped segment", ErrorCode.OUT_OF_BOUNDS,
                                retryable=False)
        return m

    def _copy(self, item: WorkItem) -> None:
        region, off, n = self._checked_region(item).array, item.offset, item.length
        host = item.buffer.host_view(item.buffer_offset, n)
        if item.op is TransferOp.READ:
            parallel_copyto(host, region[off:off + n], self._copy_threads, self._split_min)
        else:
            parallel_copyto(region[off:off + n], host, self._copy_threads, self._split_min)

    def _queue_gpu(self, item: WorkItem) -> tuple[tuple[int, int], np.ndarray]:
        """Queue a GPU item's copy; returns the ``(device, stream)`` it is on and
        the mapped region it copies from or to."""
        rt = self._runtime()
        m = self._checked_region(item)
        off, n = item.offset, item.length
        buf = item.buffer
        self._ensure_registered(m, rt, item.local)
        device = buf.device_index
        stream = rt.side_stream(device) if item.independent else LEGACY_STREAM
        rt.set_device(device)
        region = m.array
        seg_ptr = int(region.ctypes.data) + off
        gpu_ptr = buf.ptr + item.buffer_offset
        try:
            if item.op is TransferOp.READ:
                rt.memcpy_async(gpu_ptr, seg_ptr, n, stream)
            else:
                rt.memcpy_async(seg_ptr, gpu_ptr, n, stream)
        except TransferError:
            raise
        except Exception as exc:  # a backend's own error type
            raise TransferError(f"CUDA copy failed: {exc}", ErrorCode.TRANSFER_FAIL) from exc
        return (device, stream), region

    def copy_gpu(self, jobs: Sequence[tuple[SegmentDescriptor, LocalSegment | None, int, int, int]],
                 write: bool, device: int, independent: bool) -> None:
        """Copy every job ``(segment, owned segment or None, segment offset, GPU
        address, bytes)`` between GPU memory on ``device`` and same-host memory
        segments (``write``: GPU -> segment), with no work items: the engine's
        per-request bookkeeping costs more than queueing a DMA, and a batch's
        copies are its hot path (a pipelined KV load, a GPU put). The copies are
        queued back to back on one stream (ranges adjacent on both sides merged
        into one copy) and waited for once. Raises TransferError (ranges are
        checked before anything is queued; a CUDA error fails the whole call)."""
        rt = self._runtime()
        if self.closed:
            raise TransferError("shm transport closed", ErrorCode.CLOSED)
        bases: dict[str, tuple[int, int]] = {}
        keep: list[np.ndarray] = []  # mappings stay referenced until the copies are done
        runs: list[list[int]] = []  # [segment address, GPU address, bytes]
        total = 0
        for seg, local, off, gpu_ptr, n in jobs:
            found = bases.get(seg.segment_id)
            if found is None:
                m = self._mapping(seg, local)
                self._ensure_registered(m, rt, local)
                keep.append(m.array)
                found = bases[seg.segment_id] = (m.address, m.array.size)
            base, size = found
            if off < 0 or n < 0 or off + n > size:
                raise TransferError("range outside mapped segment", ErrorCode.OUT_OF_BOUNDS,
                                    retryable=False)
            addr = base + off
            total += n
            if runs:
                last = runs[-1]
                if last[0] + last[2] == addr and last[1] + last[2] == gpu_ptr:
                    last[2] += n
                    continue
            runs.append([addr, gpu_ptr, n])
        try:
            stream = rt.side_stream(device) if independent else LEGACY_STREAM
            rt.set_device(device)
            if write:
                for addr, gpu_ptr, n in runs:
                    rt.memcpy_async(addr, gpu_ptr, n, stream)
            else:
                for addr, gpu_ptr, n in runs:
                    rt.memcpy_async(gpu_ptr, addr, n, stream)
            rt.stream_synchronize(stream)
        except TransferError:
            raise
        except Exception as exc:  # a backend's own error type
            raise TransferError(f"CUDA copy failed: {exc}", ErrorCode.TRANSFER_FAIL) from exc
        self.bytes_copied += total
        del keep

    def stats(self) -> dict[str, int]:
        return {"mapped_segments": len(self._maps), "bytes_copied": self.bytes_copied}

    def close(self) -> None:
        super().close()
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            self._drop(m)
