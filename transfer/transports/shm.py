"""``shm``: same-host memory segments, copied directly with no server hop.

The mapping of a peer's segment (``/dev/shm/<descriptor.name>``) is the
segment registry's (one per file, shared by everything in the process); a
segment this process owns is used in place. Host buffers are copied with
numpy (memcpy, GIL released; a small copy through memoryviews, a large one
split across threads by :func:`kvpool.transfer.copy.parallel_copyto`). GPU
buffers: the mapping is registered with CUDA once (cudaHostRegister) so a
copy is direct DMA between GPU and the segment; a batch's GPU copies are
queued back to back (ranges adjacent on both sides merged into one copy) and
waited for once per stream (the legacy default stream, or a non-blocking
stream for batches submitted inside
:func:`kvpool.transfer.gpu.independent_copies`).

No capability is checked here: a same-host segment is a mode-0600 file in
/dev/shm, so only the same user on the same host can map it at all. That is
the documented trust boundary (docs/security.md, "Shared memory on one
host"); capabilities guard the network path through transfer servers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np

from kvpool.core.config import parse_size
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.copy import DEFAULT_SPLIT_MIN_BYTES, parallel_copyto
from kvpool.transfer.gpu import LEGACY_STREAM, CudaRuntime, cuda_runtime
from kvpool.transfer.registry import ShmMapping
from kvpool.transfer.segment import SHM_DIR, LocalSegment, MemorySegment
from kvpool.transfer.transports.base import (
    ReportFn,
    Transport,
    WorkItem,
    as_transfer_error,
    report_done,
)
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["ShmTransport"]

log = logging.getLogger(__name__)
_READ = TransferOp.READ


class ShmTransport(Transport):
    """Direct copies into same-host shared-memory segments."""

    name = "shm"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
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

    def _mapping(self, seg: SegmentDescriptor, local: LocalSegment | None) -> ShmMapping:
        assert self.ctx is not None, "attach() first"
        return self.ctx.registry.mapping(seg, local)

    def _ensure_registered(self, m: ShmMapping, rt: CudaRuntime,
                           local: LocalSegment | None) -> None:
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
        """Host items are copied one by one (the mapping looked up once per run
        of items of one segment); GPU items are queued on their stream and
        reported after one synchronisation per stream."""
        if self._closed:
            for item in items:
                report(item, TransferError("shm transport closed", ErrorCode.CLOSED))
            return
        assert self.ctx is not None, "attach() first"
        mapping = self.ctx.registry.mapping
        done: list[WorkItem] = []
        gpu: list[WorkItem] | None = None
        split_min = self._split_min
        last: str | None = None
        region: np.ndarray | None = None
        rview: memoryview | None = None
        size = copied = 0
        for item in items:
            buf = item.buffer
            if buf.device == "cuda":
                if gpu is None:
                    gpu = []
                gpu.append(item)
                continue
            sid = item.segment_id
            if sid != last:
                try:
                    m = mapping(item.segment, item.local)
                except (TransferError, OSError, ValueError) as exc:
                    report(item, as_transfer_error(exc, "shm copy"))
                    last = None
                    continue
                region, rview = m.array, m.view
                last, size = sid, region.size
            off, n = item.offset, item.length
            if n >= split_min and time.monotonic() > deadline:
                report(item, TransferError("deadline passed", ErrorCode.TIMEOUT))
                continue
            if off + n > size:
                report(item, TransferError("range outside mapped segment",
                                           ErrorCode.OUT_OF_BOUNDS, retryable=False))
                continue
            boff = item.buffer_offset
            arr = buf.array
            try:
                if n < split_min:
                    # through memoryviews: half the time of a numpy slice assignment
                    # for a small copy (either raises for another layout: numpy's then)
                    try:
                        if item.op is _READ:
                            arr.data[boff:boff + n] = rview[off:off + n]  # type: ignore[index]
                        elif boff == 0 and n == arr.size:  # a whole buffer: no slice of it
                            rview[off:off + n] = arr  # type: ignore[index]
                        else:
                            rview[off:off + n] = arr.data[boff:boff + n]  # type: ignore[index]
                    except (ValueError, TypeError):
                        if item.op is _READ:
                            arr[boff:boff + n] = region[off:off + n]  # type: ignore[index]
                        else:
                            region[off:off + n] = arr[boff:boff + n]  # type: ignore[index]
                elif item.op is _READ:
                    parallel_copyto(arr[boff:boff + n], region[off:off + n],  # type: ignore[index]
                                    self._copy_threads, split_min)
                else:
                    parallel_copyto(region[off:off + n], arr[boff:boff + n],  # type: ignore[index]
                                    self._copy_threads, split_min)
            except (OSError, ValueError, TypeError) as exc:
                report(item, TransferError(f"shm copy failed: {exc}", ErrorCode.TRANSFER_FAIL))
                continue
            copied += n
            done.append(item)
        self.bytes_copied += copied
        if done:
            report_done(report, done)
        if gpu is not None:
            self._execute_gpu(gpu, report)

    def _execute_gpu(self, items: Sequence[WorkItem], report: ReportFn) -> None:
        """Queue every GPU item's copy on its (device, stream), ranges adjacent
        on both sides merged into one copy, then wait once per stream and
        report. A range or CUDA error fails the items it concerns."""
        try:
            rt = self._runtime()
        except TransferError as exc:
            for item in items:
                report(item, exc)
            return
        # (device, stream) -> items, and the mappings they copy from or to (kept
        # referenced until the copies are done: a referenced mapping is never unmapped)
        queued: dict[tuple[int, int], tuple[list[WorkItem], list[list[int]], list[np.ndarray]]] = {}
        for item in items:
            try:
                m = self._mapping(item.segment, item.local)
                if item.offset + item.length > m.array.size:
                    raise TransferError("range outside mapped segment", ErrorCode.OUT_OF_BOUNDS,
                                        retryable=False)
                self._ensure_registered(m, rt, item.local)
            except (TransferError, OSError, ValueError) as exc:
                report(item, as_transfer_error(exc, "shm copy"))
                continue
            buf = item.buffer
            stream = rt.side_stream(buf.device_index) if item.independent else LEGACY_STREAM
            its, runs, keep = queued.setdefault((buf.device_index, stream), ([], [], []))
            its.append(item)
            keep.append(m.array)
            # [segment address, GPU address, bytes, 1 for READ]
            addr, ptr, n = m.address + item.offset, buf.ptr + item.buffer_offset, item.length
            read = 1 if item.op is _READ else 0
            if runs:
                r = runs[-1]
                if r[3] == read and r[0] + r[2] == addr and r[1] + r[2] == ptr:
                    r[2] += n
                    continue
            runs.append([addr, ptr, n, read])
        for (device, stream), (its, runs, _keep) in queued.items():
            err: TransferError | None = None
            try:
                rt.set_device(device)
                for addr, ptr, n, read in runs:
                    if read:
                        rt.memcpy_async(ptr, addr, n, stream)
                    else:
                        rt.memcpy_async(addr, ptr, n, stream)
                rt.stream_synchronize(stream)
            except Exception as exc:  # TransferError, or a backend's own error type
                err = as_transfer_error(exc, "CUDA copy")
            if err is not None:
                for item in its:
                    report(item, err)
                continue
            self.bytes_copied += sum(r[2] for r in runs)
            report_done(report, its)

    def stats(self) -> dict[str, int]:
        assert self.ctx is not None
        return {"mapped_segments": self.ctx.registry.mapped(), "bytes_copied": self.bytes_copied}
