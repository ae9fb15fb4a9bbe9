"""``gds``: same-host file segments through kvikio ``CuFile`` (GPU and host buffers).

kvikio uses GPUDirect Storage (cuFile) where the nvidia-fs driver exists and
its POSIX compatibility mode elsewhere (thread pool + bounce buffers); which
one is in effect is reported by :meth:`GdsTransport.stats` (``compat_mode``).
kvikio is imported lazily (the ``gds`` extra: ``pip install kvpool[gds]``).

Facts this module is built on (see DESIGN.md): ``import kvikio`` works on a
machine without a GPU, but every read/write, host buffers included, needs the
CUDA driver (``libcuda.so.1``) even in compatibility mode; so without a driver
and a device :meth:`available` is false with that reason and the selector
falls back to ``posix``. kvikio's futures do not keep their buffers alive, so
each in-flight future is held together with its buffer until it completes
(even past a deadline: an abandoned future keeps its buffer until it is done).

Options (``transports.gds.options``): ``task_size`` (bytes per kvikio task,
default kvikio's); ``threads`` (kvikio's thread pool is raised to at least this
many threads, default 4; kvikio's own default is 1, which in compatibility
mode runs each request's tasks one after the other, every bounce copy leaving
the disk idle; several threads overlap one task's copy with another's write.
The pool is process-wide: it is only ever raised, never lowered, so
``KVIKIO_NTHREADS`` set higher wins).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer.file_segment import FileSegment, check_peer_header
from kvpool.transfer.gpu import cuda_runtime
from kvpool.transfer.transports.base import PeerFiles, ReportFn, Transport, WorkItem
from kvpool.transfer.types import TransferError, TransferOp

__all__ = ["GdsTransport", "kvikio_status"]

log = logging.getLogger(__name__)

_POLL_S = 0.0005


class _CudaView:
    """A minimal ``__cuda_array_interface__`` object over a raw device range,
    so kvikio can take any GPU buffer (torch, cupy, raw pointer) without cupy.
    Holds a reference to the buffer's owner."""

    def __init__(self, ptr: int, n: int, owner: Any) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


@dataclass(eq=False)
class _InFlight:
    item: WorkItem
    future: Any
    buf: Any  # kept alive until the future completes (kvikio does not)
    started: float


def _compat_mode(kvikio: Any) -> str:
    """kvikio's compatibility mode setting as text (API differs across versions)."""
    defaults = getattr(kvikio, "defaults", None)
    for getter in (lambda: defaults.get("compat_mode"),  # type: ignore[union-attr]
                   lambda: defaults.compat_mode()):  # type: ignore[union-attr]
        try:
            value = getter()
        except Exception:
            continue
        return str(getattr(value, "name", value))
    return "unknown"


def _raise_threads(kvikio: Any, want: int) -> int | None:
    """Raise kvikio's process-wide thread pool to ``want`` threads (never
    lower it); the resulting size, or None where this kvikio has no such
    setting (API differs across versions)."""
    defaults = getattr(kvikio, "defaults", None)
    try:
        have = int(defaults.get("num_threads"))  # type: ignore[union-attr]
        if have < want:
            defaults.set("num_threads", want)  # type: ignore[union-attr]
        return int(defaults.get("num_threads"))  # type: ignore[union-attr]
    except Exception:
        pass
    try:  # kvikio < 24.12
        have = int(defaults.get_num_threads())  # type: ignore[union-attr]
        if have < want:
            defaults.num_threads_reset(want)  # type: ignore[union-attr]
        return int(defaults.get_num_threads())  # type: ignore[union-attr]
    except Exception:
        log.debug("cannot set kvikio's thread count", exc_info=True)
        return None


def kvikio_status() -> tuple[Any | None, str]:
    """(kvikio module, "") when kvikio can do I/O here, else (None, reason)."""
    try:
        import kvikio
    except ImportError as exc:
        return None, f"kvikio not installed (the gds extra: pip install 'kvpool[gds]'): {exc}"
    try:  # ``import kvikio`` does not import its ``defaults`` submodule (kvikio 26.x)
        import kvikio.defaults
    except ImportError:
        log.debug("kvikio.defaults not importable", exc_info=True)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, ("kvikio needs the CUDA driver (libcuda.so.1) for every read/write, even "
                      f"in compatibility mode: {exc}")
    rt, reason = cuda_runtime()
    if rt is None:
        return None, f"kvikio unusable: {reason}"
    return kvikio, ""


class GdsTransport(Transport):
    """kvikio CuFile reads/writes between GPU or host buffers and segment files."""

    name = "gds"

    def __init__(self, settings=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings)
        self.task_size: int | None = self.settings.options.get("task_size")
        self.threads = max(1, int(self.settings.options.get("threads", 4)))
        self.kvikio_threads: int | None = None
        self._kvikio: Any = None
        self._files: PeerFiles[Any] = PeerFiles(self._open_peer)  # peer segments' CuFiles
        self._lock = threading.Lock()
        self._orphans: list[_InFlight] = []  # timed-out futures still holding buffers
        self.compat_mode = "unknown"
        self.bytes_read = 0
        self.bytes_written = 0

    def available(self) -> tuple[bool, str]:
        mod, reason = kvikio_status()
        if mod is None:
            return False, reason
        self._kvikio = mod
        self.compat_mode = _compat_mode(mod)
        self.kvikio_threads = _raise_threads(mod, self.threads)
        log.info("gds: kvikio %s, compat_mode=%s, threads=%s",
                 getattr(mod, "__version__", "?"), self.compat_mode, self.kvikio_threads)
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return kind == SegmentKind.FILE and same_host and device in ("cpu", "cuda")

    # -- files ------------------------------------------------------------------
    def _cufile(self, item: WorkItem) -> Any:
        local = item.local
        kvikio = self._kvikio
        if kvikio is None:
            raise TransferError("gds transport not available", ErrorCode.TRANSPORT_UNAVAILABLE,
                                retryable=False)
        if isinstance(local, FileSegment):
            with self._lock:
                f = local.cache.get("kvikio")
                if f is None:
                    if local.closed:
                        raise TransferError(f"file segment {local.segment_id} is closed",
                                            ErrorCode.CLOSED, retryable=False)
                    f = kvikio.CuFile(local.path, "r+")
                    local.cache["kvikio"] = f
                    local.cache["close_hook"] = f.close
                return f
        return self._files.get(item)

    def _open_peer(self, desc: SegmentDescriptor) -> Any:
        check_peer_header(desc)
        return self._kvikio.CuFile(desc.name, "r+")

    def forget_segment(self, segment_id: str) -> None:
        self._files.forget(segment_id)

    @staticmethod
    def _kv_buffer(item: WorkItem) -> Any:
        b = item.buffer
        if b.is_gpu:
            return _CudaView(b.ptr + item.buffer_offset, item.length, b.owner)
        return b.host_view(item.buffer_offset, item.length)

    # -- execute ----------------------------------------------------------------
    def _reap_orphans(self) -> None:
        with self._lock:
            self._orphans = [o for o in self._orphans if not self._done(o.future)]

    @staticmethod
    def _done(future: Any) -> bool:
        try:
            return bool(future.done())
        except Exception:
            return True

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        self._reap_orphans()
        inflight: list[_InFlight] = []
        for item in items:
            if self.closed:
                report(item, TransferError("gds transport closed", ErrorCode.CLOSED))
                continue
            try:
                f = self._cufile(item)
                buf = self._kv_buffer(item)
                if item.buffer.is_gpu:
                    cuda_runtime()[0].set_device(item.buffer.device_index)  # type: ignore[union-attr]
                pos = item.segment.base_offset + item.offset
                if item.op is TransferOp.READ:
                    fut = f.pread(buf, item.length, pos, self.task_size)
                else:
                    fut = f.pwrite(buf, item.length, pos, self.task_size)
            except TransferError as exc:
                report(item, exc)
                continue
            except Exception as exc:  # kvikio raises RuntimeError/OSError/CUfile errors
                report(item, TransferError(f"kvikio submit failed: {type(exc).__name__}: {exc}",
                                           ErrorCode.TRANSFER_FAIL))
                continue
            inflight.append(_InFlight(item, fut, buf, time.monotonic()))
        for fl in inflight:
            self._wait(fl, deadline, report)

    def _wait(self, fl: _InFlight, deadline: float, report: ReportFn) -> None:
        while not self._done(fl.future):
            if time.monotonic() > deadline:
                with self._lock:
                    self._orphans.append(fl)  # keep the buffer alive until kvikio is done
                report(fl.item, TransferError("kvikio I/O not done by the deadline",
                                              ErrorCode.TIMEOUT))
                return
            time.sleep(_POLL_S)
        try:
            n = int(fl.future.get())
        except Exception as exc:
            report(fl.item, TransferError(f"kvikio I/O failed: {type(exc).__name__}: {exc}",
                                          ErrorCode.TRANSFER_FAIL))
            return
        if n != fl.item.length:
            report(fl.item, TransferError(f"kvikio moved {n} of {fl.item.length} bytes",
                                          ErrorCode.TRANSFER_FAIL))
            return
        if fl.item.op is TransferOp.READ:
            self.bytes_read += n
        else:
            self.bytes_written += n
        report(fl.item, None)

    def stats(self) -> dict[str, Any]:
        return {"compat_mode": self.compat_mode, "kvikio_threads": self.kvikio_threads,
                "open_peer_files": len(self._files),
                "orphaned_futures": len(self._orphans), "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written}

    def close(self) -> None:
        super().close()
        files = self._files.take_all()
        with self._lock:
            orphans, self._orphans = self._orphans, []
        for o in orphans:  # wait: their buffers must outlive the I/O
            try:
                o.future.get()
            except Exception:
                pass
        for f in files:
            try:
                f.close()
            except Exception:
                log.debug("CuFile close failed", exc_info=True)
