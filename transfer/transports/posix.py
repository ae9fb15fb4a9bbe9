"""``posix``: same-host file segments through the kernel (host staging).

Host buffers: ``os.preadv``/``os.pwritev`` straight into/out of the caller's
buffer (no intermediate bytes). A range whose file offset, length and buffer
address are all 4 KiB aligned goes through an ``O_DIRECT`` descriptor (no page
cache) where the filesystem allows it (option ``o_direct: false`` turns that
off). GPU buffers bounce through a pool of pinned host buffers
(``staging_buffers`` x ``staging_size``), chunk by chunk and pipelined: up
to ``pipeline_depth`` buffers per request, the file I/O of one chunk (on a
small I/O thread pool) overlapping the cudaMemcpy of the next.

A segment this process owns (:class:`FileSegment`) is used through its own
descriptors; a same-host peer's segment file is opened by path (the
descriptor's ``name``), its header checked against the descriptor (segment id,
base offset, size) and the descriptors cached until ``forget_segment``.

Options (``transports.posix.options``): ``o_direct`` (bool, default true);
``pipeline_depth`` (pinned buffers one GPU request uses at once and I/O
threads, default 4; 1 = serial bounce).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.file_segment import FileIO, FileSegment, check_peer_header
from kvpool.transfer.gpu import PinnedPool, cuda_runtime
from kvpool.transfer.transports.base import (
    PeerFiles,
    ReportFn,
    Transport,
    WorkItem,
    as_transfer_error,
)
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["PosixTransport", "open_peer_file"]

log = logging.getLogger(__name__)


def open_peer_file(desc: SegmentDescriptor, direct: bool = True) -> FileIO:
    """Open the segment file a descriptor names after checking that its
    header is the one the descriptor describes (SEGMENT_MISMATCH if not)."""
    check_peer_header(desc)
    return FileIO(desc.name, writable=True, direct=direct)


class PosixTransport(Transport):
    """preadv/pwritev between buffers and same-host segment files."""

    name = "posix"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
        self.o_direct = bool(self.settings.options.get("o_direct", True))
        self._files = PeerFiles(lambda desc: open_peer_file(desc, direct=self.o_direct))
        self._pool: PinnedPool | None = None
        self._pool_lock = threading.Lock()
        self._io: ThreadPoolExecutor | None = None
        self.pipeline_depth = max(1, int(self.settings.options.get("pipeline_depth", 4)))
        self.bytes_read = 0
        self.bytes_written = 0

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        if kind != SegmentKind.FILE or not same_host:
            return False
        return device == "cpu" or cuda_runtime()[0] is not None

    # -- files ------------------------------------------------------------------
    def _file(self, item: WorkItem) -> FileIO:
        local = item.local
        if isinstance(local, FileSegment):
            if local.closed:
                raise TransferError(f"file segment {local.segment_id} is closed",
                                    ErrorCode.CLOSED, retryable=False)
            return local.io
        return self._files.get(item)

    def forget_segment(self, segment_id: str) -> None:
        self._files.forget(segment_id)

    def _staging(self) -> PinnedPool:
        with self._pool_lock:
            if self._pool is None:
                rt, reason = cuda_runtime()
                if rt is None:
                    raise TransferError(reason, ErrorCode.TRANSPORT_UNAVAILABLE, retryable=False)
                self._pool = PinnedPool(rt, self.settings.staging_buffers,
                                        self.settings.staging_bytes)
            return self._pool

    # -- execute ----------------------------------------------------------------
    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        for item in items:
            if self.closed:
                report(item, TransferError("posix transport closed", ErrorCode.CLOSED))
                continue
            if time.monotonic() > deadline:
                report(item, TransferError("deadline passed", ErrorCode.TIMEOUT))
                continue
            try:
                self._one(item, deadline)
            except (TransferError, OSError, ValueError) as exc:
                report(item, as_transfer_error(exc, "posix I/O"))
                continue
            if item.op is TransferOp.READ:
                self.bytes_read += item.length
            else:
                self.bytes_written += item.length
            report(item, None)

    def _one(self, item: WorkItem, deadline: float) -> None:
        fio = self._file(item)
        pos = item.segment.base_offset + item.offset
        buf = item.buffer
        if not buf.is_gpu:
            view = buf.host_view(item.buffer_offset, item.length)
            if item.op is TransferOp.READ:
                fio.read(pos, view)
            else:
                fio.write(pos, view)
            return
        self._gpu(item, fio, pos, deadline)

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(max_workers=self.pipeline_depth,
                                              thread_name_prefix="kvpool-posix-io")
            return self._io

    def _gpu(self, item: WorkItem, fio: FileIO, pos: int, deadline: float) -> None:
        """Pipelined bounce through up to ``pipeline_depth`` pinned buffers:
        disk <-> pinned <-> GPU, chunk by chunk, the file I/O of some chunks
        running on the I/O threads while this thread does the cudaMemcpy of
        another (a serial bounce leaves the disk idle during every copy)."""
        pool = self._staging()
        pool.rt.set_device(item.buffer.device_index)
        slots = [pool.acquire(max(0.0, deadline - time.monotonic()))]
        nchunks = -(-item.length // pool.size)
        while len(slots) < min(self.pipeline_depth, nchunks):
            extra = pool.try_acquire()  # never wait for more: one buffer is enough to progress
            if extra < 0:
                break
            slots.append(extra)
        inflight: deque[tuple[Future[None], int]] = deque()
        try:
            if item.op is TransferOp.READ:
                self._gpu_read(item, fio, pos, deadline, pool, slots, inflight)
            else:
                self._gpu_write(item, fio, pos, deadline, pool, slots, inflight)
        finally:
            # a staging buffer goes back to the pool only once no I/O uses it
            for fut, _ in inflight:
                try:
                    fut.result()
                except Exception:
                    log.debug("posix staged I/O failed after an earlier error", exc_info=True)
            for slot in slots:
                pool.release(slot)

    @staticmethod
    def _check_deadline(deadline: float) -> None:
        if time.monotonic() > deadline:
            raise TransferError("deadline passed during GPU staging", ErrorCode.TIMEOUT)

    def _gpu_write(self, item: WorkItem, fio: FileIO, pos: int, deadline: float,
                   pool: PinnedPool, slots: list[int],
                   inflight: deque[tuple[Future[None], int]]) -> None:
        """D2H chunk i+1 into a free buffer while chunk i's pwritev runs."""
        io = self._io_pool()
        gpu = item.buffer.ptr + item.buffer_offset
        free = list(slots)
        done = 0
        while done < item.length:
            self._check_deadline(deadline)
            if not free:  # every buffer is being written: wait for the oldest
                fut, slot = inflight.popleft()
                fut.result()
                free.append(slot)
            slot = free.pop()
            n = min(pool.size, item.length - done)
            pool.rt.copy(pool.ptr(slot), gpu + done, n, item.buffer.device_index,
                         item.independent)
            inflight.append((io.submit(fio.write, pos + done, pool.array(slot)[:n]), slot))
            done += n
        while inflight:
            fut, _ = inflight[0]
            fut.result()
            inflight.popleft()

    def _gpu_read(self, item: WorkItem, fio: FileIO, pos: int, deadline: float,
                  pool: PinnedPool, slots: list[int],
                  inflight: deque[tuple[Future[None], int]]) -> None:
        """preadv of the next chunks into free buffers while chunk i goes H2D."""
        io = self._io_pool()
        gpu = item.buffer.ptr + item.buffer_offset
        submitted = 0  # bytes whose read has been queued
        copied = 0

        def submit(slot: int) -> None:
            nonlocal submitted
            n = min(pool.size, item.length - submitted)
            inflight.append((io.submit(fio.read, pos + submitted, pool.array(slot)[:n]), slot))
            submitted += n

        for slot in slots:
            if submitted < item.length:
                submit(slot)
        while copied < item.length:
            self._check_deadline(deadline)
            fut, slot = inflight[0]
            fut.result()
            inflight.popleft()
            n = min(pool.size, item.length - copied)
            pool.rt.copy(gpu + copied, pool.ptr(slot), n, item.buffer.device_index,
                         item.independent)
            copied += n
            if submitted < item.length:
                submit(slot)

    def stats(self) -> dict[str, Any]:
        return {"open_peer_files": len(self._files), "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "o_direct": self.o_direct}

    def close(self) -> None:
        super().close()
        for fio in self._files.take_all():
            fio.close()
        with self._pool_lock:
            io, self._io = self._io, None
        if io is not None:  # no staged I/O may outlive the pinned buffers it uses
            io.shutdown(wait=True)
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
