"""as_buffer / BufferHandle over every host buffer kind."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from kvpool.core.errors import ErrorCode
from kvpool.transfer import BufferHandle, TransferError, as_buffer


def _addr_of(obj: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(obj)).from_buffer(obj))


def test_bytes_is_readonly() -> None:
    h = as_buffer(b"hello")
    assert (h.length, h.device, h.readonly) == (5, "cpu", True)
    assert bytes(h.host_view()) == b"hello"


def test_bytes_and_bytearray_address_is_their_data() -> None:
    """``ptr`` of bytes / bytearray (the fast path) is where their bytes are."""
    data = bytes(range(256)) * 16
    h = as_buffer(data)
    assert h.ptr == h.array.ctypes.data and ctypes.string_at(h.ptr, len(data)) == data
    ba = bytearray(data)
    hb = as_buffer(ba)
    assert hb.ptr == _addr_of(ba) and not hb.readonly and hb.length == len(data)
    assert as_buffer(b"").length == 0 and as_buffer(bytearray()).ptr == 0
    assert as_buffer(data, length=10).length == 10


def test_bytearray_memoryview_numpy_share_memory() -> None:
    ba = bytearray(16)
    for obj in (ba, memoryview(ba), np.frombuffer(ba, dtype=np.uint8)):
        h = as_buffer(obj)
        assert not h.readonly and h.length == 16
        h.host_view(4, 2)[:] = 7
    assert ba[4:6] == b"\x07\x07"


def test_numpy_multibyte_and_2d() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = as_buffer(a)
    assert h.length == 48 and h.ptr == a.ctypes.data
    assert bytes(h.host_view()) == a.tobytes()


def test_noncontiguous_refused() -> None:
    a = np.zeros((4, 4), dtype=np.uint8)[:, ::2]
    with pytest.raises(TransferError) as ei:
        as_buffer(a)
    assert ei.value.code == ErrorCode.INVALID_PARAMS


def test_addr_len_tuple_and_int_pointer() -> None:
    ba = bytearray(b"abcdefgh")
    addr = _addr_of(ba)
    h = as_buffer((addr, 8))
    assert bytes(h.host_view()) == b"abcdefgh"
    h2 = as_buffer(addr + 2, length=3)
    h2.host_view()[:] = np.frombuffer(b"XYZ", np.uint8)
    assert ba == bytearray(b"abXYZfgh")
    with pytest.raises(TransferError):
        as_buffer(addr)  # a raw int needs length=


def test_raw_cuda_pointer_is_not_touched() -> None:
    h = as_buffer((0x7F0000000000, 4096), device="cuda")
    assert h.is_gpu and h.array is None and h.length == 4096
    with pytest.raises(TransferError):
        h.host_view()


def test_mmap_and_length_shrink() -> None:
    mm = mmap.mmap(-1, 4096)
    h = as_buffer(mm, length=100)
    assert h.length == 100 and h.host_view().size == 100
    with pytest.raises(TransferError) as ei:
        as_buffer(bytearray(10), length=11)
    assert ei.value.code == ErrorCode.BUFFER_OVERFLOW
    h.close()
    mm.close()


def test_check_range() -> None:
    h = as_buffer(bytearray(10))
    h.check_range(0, 10)
    with pytest.raises(TransferError) as ei:
        h.check_range(5, 6)
    assert ei.value.code == ErrorCode.BUFFER_OVERFLOW


def test_unsupported_object() -> None:
    with pytest.raises(TransferError) as ei:
        as_buffer(object())
    assert ei.value.code == ErrorCode.INVALID_PARAMS
    assert isinstance(as_buffer(bytearray(1)), BufferHandle)


def test_torch_cpu_tensor() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    t = torch.arange(10, dtype=torch.int32)
    h = as_buffer(t)
    assert h.length == 40 and h.ptr == t.data_ptr() and h.device == "cpu"
    h.host_view()[:4] = 0xFF
    assert int(t[0]) == -1
