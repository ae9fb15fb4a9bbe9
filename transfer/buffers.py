"""Caller buffers: one uniform view (address, length, device) of host and GPU memory.

:func:`as_buffer` accepts

- host objects exposing the buffer protocol (``bytes`` — read-only, so only a
  WRITE source —, ``bytearray``, ``memoryview``, ``mmap``, numpy arrays),
- torch CPU tensors (``data_ptr()``), torch CUDA tensors and cupy arrays
  (``__cuda_array_interface__``), other GPU objects via DLPack,
- a raw ``(address, length)`` pair or an ``int`` address with ``length=``
  (``device="cuda"`` marks a raw device pointer).

Every buffer must be contiguous. A :class:`BufferHandle` keeps the object
alive while the handle exists; GPU libraries are only imported if a GPU object
is given.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.transfer.types import TransferError

__all__ = ["BufferHandle", "as_buffer"]

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_CUDA_HOST = 3
_KDL_CUDA_MANAGED = 13
_C_VOID_P = ctypes.c_void_p
_U8 = np.dtype(np.uint8)


class BufferHandle:
    """A contiguous byte range of host (``device="cpu"``) or GPU memory.

    ``ptr`` is the address of the first byte, ``length`` the size in bytes.
    ``array`` is a 1-D uint8 numpy view for host buffers (None for GPU).
    ``readonly`` buffers may only be WRITE sources. ``registered`` is set by
    ``TransferEngine.register_buffer``; transports may cache per-handle state
    (e.g. CUDA registration) in ``cache``. A host handle made from an array
    learns its address on first use of ``ptr`` (finding it costs more than
    the copies most host requests make).
    """

    __slots__ = ("__weakref__", "_cache", "_ptr", "array", "device", "device_index", "length",
                 "owner", "readonly", "registered")

    def __init__(self, ptr: int | None = 0, length: int = 0, device: str = "cpu",
                 device_index: int = 0, readonly: bool = False, array: np.ndarray | None = None,
                 owner: Any = None, registered: bool = False,
                 cache: dict[str, Any] | None = None) -> None:
        self._ptr = ptr
        self.length = length
        self.device = device
        self.device_index = device_index
        self.readonly = readonly
        self.array = array
        self.owner = owner
        self.registered = registered
        self._cache = cache

    @property
    def ptr(self) -> int:
        ptr = self._ptr
        if ptr is None:
            arr = self.array
            ptr = self._ptr = int(arr.ctypes.data) if arr is not None and arr.size else 0
        return ptr

    @ptr.setter
    def ptr(self, value: int) -> None:
        self._ptr = value

    @property
    def cache(self) -> dict[str, Any]:
        cache = self._cache
        if cache is None:
            cache = self._cache = {}
        return cache

    def __repr__(self) -> str:
        return (f"BufferHandle(ptr={self.ptr}, length={self.length}, device={self.device!r}, "
                f"device_index={self.device_index}, readonly={self.readonly}, "
                f"registered={self.registered})")

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"

    def host_view(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        """uint8 numpy view of ``[offset, offset+length)``; host buffers only."""
        if self.array is None:
            raise TransferError("not a host buffer", ErrorCode.INVALID_PARAMS, retryable=False)
        end = self.length if length is None else offset + length
        return self.array[offset:end]

    def check_range(self, offset: int, length: int) -> None:
        """Raise BUFFER_OVERFLOW unless ``[offset, offset+length)`` lies in the buffer."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise TransferError(
                f"buffer range [{offset}, {offset + length}) outside buffer of {self.length} bytes",
                ErrorCode.BUFFER_OVERFLOW,
                retryable=False,
            )

    def close(self) -> None:
        """Drop the reference to the underlying object."""
        self.owner = None
        self.array = None
        if self._cache is not None:
            self._cache.clear()


def _host_from_address(ptr: int, length: int, owner: Any) -> BufferHandle:
    if ptr <= 0 and length > 0:
        raise TransferError(f"invalid address {ptr:#x}", ErrorCode.INVALID_PARAMS, retryable=False)
    if length > 0:  # (frombuffer: half the time of np.ctypeslib.as_array)
        raw = (ctypes.c_ubyte * length).from_address(ptr)
        arr = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
    else:
        arr = np.empty(0, dtype=np.uint8)
    return BufferHandle(ptr=ptr, length=length, device="cpu", array=arr, owner=owner)


def _from_cai(obj: Any, cai: dict[str, Any]) -> BufferHandle:
    shape = tuple(cai.get("shape", ()))
    typestr = str(cai["typestr"])
    itemsize = np.dtype(typestr).itemsize
    strides = cai.get("strides")
    n = 1
    for s in shape:
        n *= int(s)
    if strides is not None and n > 1:
        expected = itemsize
        for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
            if dim != 1 and stride != expected:
                raise TransferError(
                    "GPU buffer is not C-contiguous", ErrorCode.INVALID_PARAMS, retryable=False
                )
            expected *= dim
    ptr, readonly = cai["data"]
    dev = 0
    get_dev = getattr(obj, "device", None)
    idx = getattr(get_dev, "index", None)
    if idx is None:
        idx = getattr(get_dev, "id", None)
    if isinstance(idx, int):
        dev = idx
    return BufferHandle(
        ptr=int(ptr), length=n * itemsize, device="cuda", device_index=dev,
        readonly=bool(readonly), owner=obj,
    )


def _from_torch(obj: Any) -> BufferHandle:
    if not obj.is_contiguous():
        raise TransferError("tensor is not contiguous", ErrorCode.INVALID_PARAMS, retryable=False)
    length = int(obj.numel()) * int(obj.element_size())
    if obj.device.type == "cuda":
        return BufferHandle(
            ptr=int(obj.data_ptr()), length=length, device="cuda",
            device_index=int(obj.device.index or 0), owner=obj,
        )
    if obj.device.type != "cpu":
        raise TransferError(
            f"unsupported tensor device {obj.device}", ErrorCode.INVALID_PARAMS, retryable=False
        )
    return _host_from_address(int(obj.data_ptr()), length, obj)


def as_buffer(obj: Any, length: int | None = None, device: str | None = None) -> BufferHandle:
    """Wrap ``obj`` as a :class:`BufferHandle` (see module doc for accepted kinds).

    ``length`` is required for a raw ``int`` address and optional otherwise
    (it may shrink the view). ``device`` ("cpu" or "cuda") only applies to raw
    addresses. Raises ``TransferError(INVALID_PARAMS)`` for anything else.
    """
    if isinstance(obj, BufferHandle):
        return obj
    h = _as_buffer(obj, length, device)
    if length is not None:
        if length < 0 or length > h.length:
            raise TransferError(
                f"length {length} exceeds buffer of {h.length} bytes",
                ErrorCode.BUFFER_OVERFLOW, retryable=False,
            )
        h.length = length
        if h.array is not None:
            h.array = h.array[:length]
    return h


def _as_buffer(obj: Any, length: int | None, device: str | None) -> BufferHandle:
    kind = type(obj)
    if kind is np.ndarray and device is None and obj.flags.c_contiguous:
        # the common host buffer: no probing for the other forms (its address is
        # found when a transport asks for it)
        # (positional arguments: keywords cost more than the rest of this call)
        arr = obj if obj.dtype is _U8 and obj.ndim == 1 else obj.reshape(-1).view(np.uint8)
        return BufferHandle(None, arr.nbytes, "cpu", 0, not obj.flags.writeable, arr, obj)
    if (kind is bytes or kind is bytearray) and device is None:
        # the common value of a single put: no probing for GPU and raw-address forms
        arr = np.frombuffer(obj, _U8)
        return BufferHandle(None, arr.nbytes, "cpu", 0, kind is bytes, arr, obj)
    if device not in (None, "cpu", "cuda"):
        raise TransferError(f"unknown device {device!r}", ErrorCode.INVALID_PARAMS, retryable=False)
    # raw address forms
    if (kind is tuple and len(obj) == 2 and type(obj[0]) is int and type(obj[1]) is int) \
            or (isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj)):
        addr, n = int(obj[0]), int(obj[1])
        if n < 0:
            raise TransferError("negative length", ErrorCode.INVALID_PARAMS, retryable=False)
        if device == "cuda":
            return BufferHandle(ptr=addr, length=n, device="cuda")
        return _host_from_address(addr, n, None)
    if isinstance(obj, int) and not isinstance(obj, bool):
        if length is None:
            raise TransferError(
                "a raw address needs length=", ErrorCode.INVALID_PARAMS, retryable=False
            )
        if device == "cuda":
            return BufferHandle(ptr=obj, length=length, device="cuda")
        return _host_from_address(obj, length, None)
    # torch (checked by module name so torch is never imported here)
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        return _from_torch(obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise TransferError("array is not C-contiguous", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        arr = obj.reshape(-1).view(np.uint8)
        return BufferHandle(
            ptr=int(arr.ctypes.data), length=arr.nbytes, device="cpu",
            readonly=not obj.flags.writeable, array=arr, owner=obj,
        )
    try:
        mv = memoryview(obj)
    except TypeError:
        mv = None
    if mv is not None:
        if not mv.c_contiguous:
            raise TransferError("buffer is not contiguous", ErrorCode.INVALID_PARAMS,
                                retryable=False)
        arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv,
                            dtype=np.uint8)
        ptr = int(arr.ctypes.data) if arr.size else 0
        return BufferHandle(
            ptr=ptr, length=arr.nbytes, device="cpu", readonly=mv.readonly, array=arr, owner=obj
        )
    dl_device = getattr(obj, "__dlpack_device__", None)
    if dl_device is not None:
        dev_type, dev_id = dl_device()
        if int(dev_type) in (_KDL_CPU, _KDL_CUDA_HOST):
            host = np.from_dlpack(obj)
            return _as_buffer(host, None, None)
        if int(dev_type) in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            import cupy  # lazily: only for a DLPack GPU object without CAI

            garr = cupy.from_dlpack(obj)
            h = _from_cai(garr, garr.__cuda_array_interface__)
            h.device_index = int(dev_id)
            return h
    raise TransferError(
        f"cannot use {type(obj).__name__} as a transfer buffer", ErrorCode.INVALID_PARAMS,
        retryable=False,
    )
