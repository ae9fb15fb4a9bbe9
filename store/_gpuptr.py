"""Classify raw integer addresses (Mooncake-style ``buffer_ptr``) as host or GPU memory."""

from __future__ import annotations

import ctypes
import logging

__all__ = ["pointer_is_device"]

log = logging.getLogger(__name__)

_DEVICE_TYPES = (2, 3)  # cudaMemoryTypeDevice, cudaMemoryTypeManaged


class _CudaPointerAttributes(ctypes.Structure):
    # CUDA >= 11 layout of cudaPointerAttributes
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


def pointer_is_device(ptr: int) -> bool:
    """True when ``ptr`` is CUDA device (or managed) memory; False for host
    memory and whenever no CUDA device is usable (then it cannot be GPU memory)."""
    from kvpool.transfer.gpu import cuda_runtime

    rt, _ = cuda_runtime()
    if rt is None:
        return False
    lib = getattr(rt, "_lib", None)
    try:
        if rt.backend == "cupy":
            attrs = lib.pointerGetAttributes(ptr)  # type: ignore[union-attr]
            return int(attrs.type) in _DEVICE_TYPES
        attr = _CudaPointerAttributes()
        rc = lib.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(ptr))  # type: ignore[union-attr]
        if rc != 0:
            lib.cudaGetLastError()  # type: ignore[union-attr]  # clear the sticky-free error
            return False
        return attr.type in _DEVICE_TYPES
    except Exception as exc:  # unknown pointer / old runtime: treat as host
        log.debug("pointer attributes of %#x: %s", ptr, exc)
        return False
