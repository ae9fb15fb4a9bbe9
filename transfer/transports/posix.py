"""``posix``: same-host file segments through the kernel (host staging).

Host buffers: ``os.preadv``/``os.pwritev`` straight into/out of the caller's
buffer (no intermediate bytes). A range whose file offset, length and buffer
address are all 4 KiB aligned goes through an ``O_DIRECT`` descriptor (no page
cache) where the filesystem allows it (option ``o_direct: false`` turns that
off). GPU buffers bounce through a pool of pinned host buffers
(``staging_buffers`` x ``staging_size``), chunk by chunk.

A segment this process owns (:class:`FileSegment`) is used through its own
descriptors; a same-host peer's segment file is opened by path (the
descriptor's ``name``), its header checked against the descriptor (segment id,
base offset, size) and the descriptors cached until ``forget_segment``.

Options (``transports.posix.options``): ``o_direct`` (bool, default true).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpool.master.errors import ErrorCode
from kvpool.master.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.file_segment import FileIO, FileSegment, SegmentFileError, read_header
from kvpool.transfer.gpu import PinnedPool, cuda_runtime
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["PosixTransport", "open_peer_file"]

log = logging.getLogger(__name__)


def open_peer_file(desc: SegmentDescriptor, direct: bool = True) -> FileIO:
    """Open the segment file a descriptor names after checking that its
    header is the one the descriptor describes (SEGMENT_MISMATCH if not)."""
    header = read_header(desc.name)
    if (header.segment_id != desc.segment_id or header.base_offset != desc.base_offset
            or header.size != desc.size):
        raise SegmentFileError(
            f"{desc.name}: holds segment {header.segment_id!r} ({header.size} B at "
            f"{header.base_offset}), descriptor says {desc.segment_id!r} ({desc.size} B at "
            f"{desc.base_offset})")
    return FileIO(desc.name, writable=True, direct=direct)


class PosixTransport(Transport):
    """preadv/pwritev between buffers and same-host segment files."""

    name = "posix"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
        self.o_direct = bool(self.settings.options.get("o_direct", True))
        self._files: dict[str, tuple[str, FileIO]] = {}
        self._lock = threading.Lock()
        self._pool: PinnedPool | None = None
        self._pool_lock = threading.Lock()
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
        if local is not None:
            raise TransferError(f"segment {item.segment.segment_id} is not a file segment",
                                ErrorCode.INVALID_PARAMS, retryable=False)
        desc = item.segment
        with self._lock:
            cached = self._files.get(desc.segment_id)
            if cached is not None and cached[0] == desc.name:
                return cached[1]
            if cached is not None:
                cached[1].close()
            fio = open_peer_file(desc, direct=self.o_direct)
            self._files[desc.segment_id] = (desc.name, fio)
            return fio

    def forget_segment(self, segment_id: str) -> None:
        with self._lock:
            cached = self._files.pop(segment_id, None)
        if cached is not None:
            cached[1].close()

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
            except TransferError as exc:
                report(item, exc)
                continue
            except (OSError, ValueError) as exc:
                report(item, TransferError(f"posix I/O failed: {exc}", ErrorCode.TRANSFER_FAIL))
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

    def _gpu(self, item: WorkItem, fio: FileIO, pos: int, deadline: float) -> None:
        """Chunked bounce through one pinned buffer: disk <-> pinned <-> GPU."""
        pool = self._staging()
        rt = pool.rt
        rt.set_device(item.buffer.device_index)
        chunk = pool.size
        slot = pool.acquire(max(0.0, deadline - time.monotonic()))
        try:
            stage = pool.array(slot)
            sptr = pool.ptr(slot)
            gpu = item.buffer.ptr + item.buffer_offset
            done = 0
            while done < item.length:
                if time.monotonic() > deadline:
                    raise TransferError("deadline passed during GPU staging", ErrorCode.TIMEOUT)
                n = min(chunk, item.length - done)
                if item.op is TransferOp.READ:
                    fio.read(pos + done, stage[:n])
                    rt.memcpy(gpu + done, sptr, n)
                else:
                    rt.memcpy(sptr, gpu + done, n)
                    fio.write(pos + done, stage[:n])
                done += n
        finally:
            pool.release(slot)

    def stats(self) -> dict[str, Any]:
        return {"open_peer_files": len(self._files), "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "o_direct": self.o_direct}

    def close(self) -> None:
        super().close()
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for _, fio in files:
            fio.close()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
