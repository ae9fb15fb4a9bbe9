"""Small buffer helpers of the store client: sizes, host views, checksums.

The transfer engine owns buffer conversion (``kvpool.transfer.as_buffer``);
the store only needs a buffer's length (to size gets and puts), a host view
(to checksum it) and an uninitialised ``bytes`` to read into without a copy.
"""

from __future__ import annotations

import ctypes
import sys
import zlib
from typing import Any

import numpy as np

from kvpool.transfer.buffers import BufferHandle, as_buffer

__all__ = [
    "alloc_bytes",
    "buffer_nbytes",
    "checksum_of",
    "host_array",
    "host_view",
    "is_gpu_buffer",
    "resolve_checksum_algo",
]

_ndarray = np.ndarray
_U8 = np.dtype(np.uint8)
# Offset of ob_sval inside a CPython bytes object (header size of b"" minus its NUL).
_BYTES_HEADER = sys.getsizeof(b"") - 1

try:  # optional, faster than crc32 on large values
    import xxhash as _xxhash  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None


def is_gpu_buffer(buf: Any) -> bool:
    """True for CUDA tensors/arrays (torch ``is_cuda``, ``__cuda_array_interface__``)."""
    if getattr(buf, "is_gpu", False) is True:  # a BufferHandle that says so
        return True
    if hasattr(buf, "__cuda_array_interface__"):
        return True
    return bool(getattr(buf, "is_cuda", False))


def buffer_nbytes(buf: Any) -> int:
    """Length in bytes of any buffer the store accepts.

    bytes/bytearray/memoryview/numpy/torch/cupy, ``(addr, length)`` tuples and
    transfer ``BufferHandle`` objects (``length``/``nbytes``/``size`` attribute).
    """
    tp = type(buf)
    if tp is _ndarray:  # the hot path's common cases
        return int(buf.nbytes)
    if tp is BufferHandle:
        return buf.length
    if isinstance(buf, bytes | bytearray):
        return len(buf)
    length = getattr(buf, "length", None)  # transfer BufferHandle (checked early: hot path)
    if isinstance(length, int) and hasattr(buf, "is_gpu"):
        return length
    if isinstance(buf, memoryview):
        return buf.nbytes
    if isinstance(buf, tuple) and len(buf) == 2:
        return int(buf[1])
    nbytes = getattr(buf, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(buf, "element_size") and hasattr(buf, "numel"):  # torch.Tensor
        return int(buf.numel()) * int(buf.element_size())
    for attr in ("length", "size"):
        v = getattr(buf, attr, None)
        if isinstance(v, int):
            return v
    return memoryview(buf).nbytes


def host_view(buf: Any) -> memoryview | None:
    """A flat byte view of a host buffer, or None (GPU memory, unknown objects)."""
    if type(buf) is BufferHandle:  # a registered or wrapped buffer: its host array
        return None if buf.is_gpu or buf.array is None else buf.array.data
    if is_gpu_buffer(buf):
        return None
    try:
        if isinstance(buf, tuple) and len(buf) == 2:
            addr, n = int(buf[0]), int(buf[1])
            if n == 0:
                return memoryview(b"")
            return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
        if hasattr(buf, "numpy") and hasattr(buf, "element_size"):  # torch CPU tensor
            buf = buf.detach().contiguous().view(-1).numpy().view("uint8")
        mv = memoryview(buf)
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    except (TypeError, ValueError, AttributeError):
        return None


def alloc_bytes(n: int) -> tuple[bytes, BufferHandle]:
    """A new ``bytes`` of ``n`` bytes plus a writable host buffer over its payload.

    The caller fills the payload (e.g. a transfer READ) before the object is
    shared or hashed, so get() returns bytes without a second copy. The
    buffer holds the ``bytes`` object (``owner``): while any transfer thread
    still holds the request, its memory cannot be freed and handed to
    another object.
    """
    b = bytes(n)
    buf = as_buffer((id(b) + _BYTES_HEADER, n))
    buf.owner = b
    return b, buf


def host_array(buf: Any) -> np.ndarray | None:
    """A flat uint8 numpy view of a host buffer, or None (GPU, non-contiguous, unknown)."""
    try:
        if type(buf) is np.ndarray and buf.dtype is _U8 and buf.ndim == 1 \
                and buf.strides[0] == 1:  # the common case: a flat uint8 array
            return buf
        if type(buf) is BufferHandle:  # a registered buffer (the other common case)
            arr = buf.array
            if buf.device == "cuda" or not isinstance(arr, np.ndarray):
                return None
            return arr if arr.size == buf.length else buf.host_view(0, buf.length)
        if isinstance(buf, bytes | bytearray):
            return np.frombuffer(buf, dtype=np.uint8)
        if isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous:
                return None
            return buf.reshape(-1).view(np.uint8)
        if isinstance(buf, tuple) and len(buf) == 2:
            addr, n = int(buf[0]), int(buf[1])
            if n == 0:
                return np.empty(0, np.uint8)
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
        if isinstance(buf, memoryview):
            return np.frombuffer(buf, dtype=np.uint8) if buf.c_contiguous else None
        host_view = getattr(buf, "host_view", None)
        if host_view is not None and hasattr(buf, "is_gpu"):  # transfer BufferHandle
            arr = getattr(buf, "array", None)
            if buf.is_gpu or not isinstance(arr, np.ndarray):
                return None
            return arr if arr.size == buf.length else host_view(0, buf.length)
    except (TypeError, ValueError, AttributeError, BufferError):
        return None
    return None


def resolve_checksum_algo(name: str) -> str | None:
    """Map a config value (none|crc32|xxhash|auto) to an available algorithm or None."""
    if name == "none":
        return None
    if name == "xxhash" or name == "auto":
        if _xxhash is not None:
            return "xxh64"
        return "crc32"
    return "crc32"


def checksum_of(algo: str, data: memoryview | bytes) -> str:
    """Self-describing checksum string (``crc32:1a2b3c4d``) so any reader can verify it."""
    if algo == "xxh64":
        if _xxhash is None:
            raise ValueError("xxhash is not installed")
        return "xxh64:" + _xxhash.xxh64_hexdigest(data)
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def verify_checksum(expected: str, data: memoryview | bytes) -> bool | None:
    """True/False when ``expected`` can be checked here; None when its algorithm is unknown."""
    algo, _, _ = expected.partition(":")
    if algo == "crc32" or (algo == "xxh64" and _xxhash is not None):
        return checksum_of(algo, data) == expected
    return None
