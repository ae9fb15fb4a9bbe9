"""Lazy CUDA runtime access for the transports (no GPU library is imported
until a GPU buffer or an availability check needs it).

Backends, in order: cupy (``cupy.cuda.runtime``) when ``cupy.cuda.is_available()``,
else the CUDA runtime library through ctypes (``libcudart`` shipped with torch or
the ``nvidia-cuda-runtime`` wheel, or the system one). Without a usable device,
:func:`cuda_runtime` returns ``(None, reason)`` and never raises.

Stream order. A plain :meth:`CudaRuntime.memcpy` is ``cudaMemcpy`` on the
legacy default stream: it waits for every kernel queued there before it and
delays every kernel queued after it, so data written by the caller's kernels
is complete when it is copied. A caller that orders its GPU work itself (the
connector: its staging buffers are written on a side stream it synchronises,
and read only after the transfer returned) submits transfers inside
:func:`independent_copies`; their copies then run on a non-blocking stream of
the copying thread and overlap the kernels of a forward instead of queueing
behind them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.transfer.types import TransferError

__all__ = ["CudaRuntime", "PinnedPool", "copies_independent", "cuda_available", "cuda_runtime",
           "independent_copies"]

log = logging.getLogger(__name__)

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault (direction inferred via unified addressing)
HOST_REGISTER_PORTABLE = 1
STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy stream
LEGACY_STREAM = 0


class _Order(threading.local):
    # a class default: reading it on a thread that never set it is a plain
    # attribute read (getattr with a default raised and caught AttributeError
    # on every submit of such a thread)
    independent = False


_order = _Order()


@contextmanager
def independent_copies() -> Iterator[None]:
    """Transfers this thread submits inside the block copy GPU memory on a
    non-blocking stream (see the module docstring): they neither wait for
    nor delay kernels on the legacy default stream. The caller guarantees
    that GPU data it writes is complete before the transfer is submitted and
    that nothing reads a transfer's destination before the call returned."""
    before = _order.independent
    _order.independent = True
    try:
        yield
    finally:
        _order.independent = before


def copies_independent() -> bool:
    """True inside :func:`independent_copies` (on this thread)."""
    return _order.independent


class CudaRuntime:
    """memcpy / host registration through one backend ("cupy" or "cudart")."""

    def __init__(self, backend: str, lib: Any) -> None:
        self.backend = backend
        self._lib = lib
        self._streams = threading.local()  # per thread: {device: non-blocking stream}

    def set_device(self, index: int) -> None:
        if self.backend == "cupy":
            self._lib.setDevice(index)
        else:
            self._check(self._lib.cudaSetDevice(ctypes.c_int(index)), "cudaSetDevice")

    def memcpy(self, dst: int, src: int, n: int) -> None:
        """Synchronous copy of ``n`` bytes (any direction, unified addressing)."""
        if n == 0:
            return
        if self.backend == "cupy":
            self._lib.memcpy(dst, src, n, MEMCPY_DEFAULT)
        else:
            self._check(
                self._lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                     ctypes.c_size_t(n), ctypes.c_int(MEMCPY_DEFAULT)),
                "cudaMemcpy",
            )

    def side_stream(self, device: int) -> int:
        """This thread's non-blocking stream on ``device`` (created on first use;
        makes ``device`` current)."""
        streams: dict[int, int] | None = getattr(self._streams, "by_device", None)
        if streams is None:
            streams = self._streams.by_device = {}
        stream = streams.get(device)
        if stream is None:
            self.set_device(device)
            if self.backend == "cupy":
                stream = int(self._lib.streamCreateWithFlags(STREAM_NON_BLOCKING))
            else:
                handle = ctypes.c_void_p(0)
                self._check(self._lib.cudaStreamCreateWithFlags(
                    ctypes.byref(handle), ctypes.c_uint(STREAM_NON_BLOCKING)),
                    "cudaStreamCreateWithFlags")
                stream = int(handle.value or 0)
            streams[device] = stream
        return stream

    def copy(self, dst: int, src: int, n: int, device: int, independent: bool) -> None:
        """Synchronous copy of ``n`` bytes: :meth:`memcpy`, or with
        ``independent`` on this thread's non-blocking stream of ``device``
        (see :func:`independent_copies`). Makes ``device`` current."""
        if not independent:
            self.set_device(device)
            self.memcpy(dst, src, n)
            return
        if n == 0:
            return
        stream = self.side_stream(device)
        self.set_device(device)
        self.memcpy_async(dst, src, n, stream)
        self.stream_synchronize(stream)

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        """Queue a copy of ``n`` bytes on ``stream`` (any direction)."""
        if n == 0:
            return
        if self.backend == "cupy":
            self._lib.memcpyAsync(dst, src, n, MEMCPY_DEFAULT, stream)
        else:
            self._check(self._lib.cudaMemcpyAsync(
                ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n),
                ctypes.c_int(MEMCPY_DEFAULT), ctypes.c_void_p(stream)), "cudaMemcpyAsync")

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, stream: int) -> None:
        """Queue ``height`` rows of ``width`` bytes, ``spitch`` apart at ``src``,
        to ``dpitch`` apart at ``dst`` on ``stream`` (pitches >= width)."""
        if width == 0 or height == 0:
            return
        if self.backend == "cupy":
            self._lib.memcpy2DAsync(dst, dpitch, src, spitch, width, height, MEMCPY_DEFAULT,
                                    stream)
        else:
            self._check(self._lib.cudaMemcpy2DAsync(
                ctypes.c_void_p(dst), ctypes.c_size_t(dpitch), ctypes.c_void_p(src),
                ctypes.c_size_t(spitch), ctypes.c_size_t(width), ctypes.c_size_t(height),
                ctypes.c_int(MEMCPY_DEFAULT), ctypes.c_void_p(stream)), "cudaMemcpy2DAsync")

    def stream_synchronize(self, stream: int) -> None:
        """Wait for ``stream`` (0: the legacy default stream)."""
        if self.backend == "cupy":
            self._lib.streamSynchronize(stream)
        else:
            self._check(self._lib.cudaStreamSynchronize(ctypes.c_void_p(stream)),
                        "cudaStreamSynchronize")

    def malloc(self, n: int, device: int) -> int:
        """``n`` bytes of device memory on ``device`` (makes it current)."""
        self.set_device(device)
        if self.backend == "cupy":
            return int(self._lib.malloc(n))
        ptr = ctypes.c_void_p(0)
        self._check(self._lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(n)), "cudaMalloc")
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        """Release memory from :meth:`malloc`."""
        if self.backend == "cupy":
            self._lib.free(ptr)
        else:
            self._check(self._lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def host_register(self, ptr: int, n: int) -> None:
        """Page-lock host memory so copies to/from the GPU are direct DMA."""
        if self.backend == "cupy":
            self._lib.hostRegister(ptr, n, HOST_REGISTER_PORTABLE)
        else:
            self._check(self._lib.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(n),
                                                   ctypes.c_uint(HOST_REGISTER_PORTABLE)),
                        "cudaHostRegister")

    def host_unregister(self, ptr: int) -> None:
        if self.backend == "cupy":
            self._lib.hostUnregister(ptr)
        else:
            self._check(self._lib.cudaHostUnregister(ctypes.c_void_p(ptr)), "cudaHostUnregister")

    def device_count(self) -> int:
        if self.backend == "cupy":
            return int(self._lib.getDeviceCount())
        n = ctypes.c_int(0)
        self._check(self._lib.cudaGetDeviceCount(ctypes.byref(n)), "cudaGetDeviceCount")
        return n.value

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"{what} failed with CUDA error {rc}", ErrorCode.TRANSFER_FAIL)


_lock = threading.Lock()
_cached: tuple[CudaRuntime | None, str] | None = None


def _cudart_candidates() -> list[str]:
    paths: list[str] = []
    for pkg, sub in (("torch", "lib"), ("nvidia", "cuda_runtime/lib")):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            paths += sorted(glob.glob(os.path.join(loc, sub, "libcudart.so*")))
    found = ctypes.util.find_library("cudart")
    if found:
        paths.append(found)
    return paths


def _probe() -> tuple[CudaRuntime | None, str]:
    reasons: list[str] = []
    try:
        import cupy

        if cupy.cuda.is_available():
            rt = CudaRuntime("cupy", cupy.cuda.runtime)
            return rt, ""
        reasons.append("cupy: no CUDA device")
    except Exception as exc:  # ImportError or a broken CUDA install
        reasons.append(f"cupy: {type(exc).__name__}: {exc}")
    for path in _cudart_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            reasons.append(f"{os.path.basename(path)}: {exc}")
            continue  # try the next copy of the library
        try:
            rt = CudaRuntime("cudart", lib)
            if rt.device_count() > 0:
                return rt, ""
            reasons.append(f"{os.path.basename(path)}: no CUDA device")
        except TransferError as exc:
            reasons.append(f"{os.path.basename(path)}: {exc}")
        break  # a loadable libcudart that sees no device decides it
    if not any("libcudart" in r for r in reasons):
        reasons.append("no libcudart found")
    return None, "no CUDA device (" + "; ".join(reasons) + ")"


def cuda_runtime() -> tuple[CudaRuntime | None, str]:
    """(runtime, "") when a CUDA device is usable, else (None, reason). Cached."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _probe()
            if _cached[0] is None:
                log.debug("CUDA unavailable: %s", _cached[1])
        return _cached


def cuda_available() -> tuple[bool, str]:
    rt, reason = cuda_runtime()
    return rt is not None, reason


class PinnedPool:
    """A fixed pool of page-locked host buffers (anonymous mmap +
    cudaHostRegister) for staging GPU data through the host.

    ``acquire(timeout)`` blocks until a buffer is free and returns its index;
    ``array(i)`` is its uint8 view, ``ptr(i)`` its address; ``release(i)``.
    """

    def __init__(self, rt: CudaRuntime, count: int, size: int) -> None:
        self.rt = rt
        self.size = size
        self._maps: list[mmap.mmap] = []
        self._arrays: list[np.ndarray] = []
        self._free: list[int] = []
        self._cond = threading.Condition()
        for i in range(count):
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                           | getattr(mmap, "MAP_POPULATE", 0))
            arr = np.frombuffer(mm, dtype=np.uint8)
            rt.host_register(int(arr.ctypes.data), size)
            self._maps.append(mm)
            self._arrays.append(arr)
            self._free.append(i)

    def acquire(self, timeout: float | None = None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                raise TransferError("no free pinned staging buffer", ErrorCode.TIMEOUT)
            return self._free.pop()

    def try_acquire(self) -> int:
        """A free buffer's index, or -1 at once when none is free."""
        with self._cond:
            return self._free.pop() if self._free else -1

    def release(self, i: int) -> None:
        with self._cond:
            self._free.append(i)
            self._cond.notify()

    def array(self, i: int) -> np.ndarray:
        return self._arrays[i]

    def ptr(self, i: int) -> int:
        return int(self._arrays[i].ctypes.data)

    def close(self) -> None:
        for arr in self._arrays:
            try:
                self.rt.host_unregister(int(arr.ctypes.data))
            except Exception:
                log.debug("hostUnregister failed", exc_info=True)
        self._arrays.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()
