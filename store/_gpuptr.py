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


_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_MEMORYTYPE_DEVICE = 2
_driver: ctypes.CDLL | bool | None = None  # None = not probed, False = absent


def _driver_memory_type(ptr: int) -> int | None:
    """The CUDA driver's memory type of ``ptr`` (2 = device), 0 when the driver
    does not know the address (plain host memory), None without a driver."""
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _driver = False
    if _driver is False:
        return None
    assert isinstance(_driver, ctypes.CDLL)
    value = ctypes.c_uint(0)
    rc = _driver.cuPointerGetAttribute(
        ctypes.byref(value), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(ptr))
    return int(value.value) if rc == 0 else 0


def pointer_is_device(ptr: int) -> bool:
    """True when ``ptr`` is CUDA device (or managed) memory; False for host
    memory and whenever no CUDA device is usable (then it cannot be GPU memory).

    Asks the driver first (``cuPointerGetAttribute``: well defined for any
    address), then the runtime. Misclassifying a device pointer as host would
    make a host memcpy dereference GPU memory, so both are consulted."""
    from kvpool.transfer.gpu import cuda_runtime

    rt, _ = cuda_runtime()
    if rt is None:
        return False
    try:
        if _driver_memory_type(int(ptr)) == _CU_MEMORYTYPE_DEVICE:
            return True
    except Exception as exc:
        log.debug("cuPointerGetAttribute(%#x): %s", ptr, exc)
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
