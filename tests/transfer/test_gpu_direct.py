"""The engine's direct GPU <-> same-host shm copies (``copy_gpu_shm``) and the
store's use of them.

This machine has no GPU: :class:`support.cuda_double.HostCudaDouble` stands
in for the CUDA runtime (hardware this machine lacks). Its "device memory" is
host memory and a cudaMemcpyAsync is a memmove, so what is tested here for real is
everything around the DMA: a real peer process's shm segment mapped and
registered once, range checks, adjacent ranges merged into one copy, one
wait per call, the selector's say, and the store's fallback to the engine.
The same paths on a real GPU: tests/transfer/test_gpu.py (run on the H200).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from kvpool.core.errors import ErrorCode
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.types import TransferError
from support.cuda_double import HostCudaDouble


def _device_buffer(data: np.ndarray) -> BufferHandle:
    """``data`` as if it were GPU memory (the fake runtime's device memory)."""
    return BufferHandle(ptr=int(data.ctypes.data), length=data.size, device="cuda",
                        owner=data)


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_adjacent_ranges_are_one_copy_and_read_back(cuda_double: HostCudaDouble,
                                                    make_engine: Any, make_peer: Any) -> None:
    peer = make_peer(1 << 20)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    staging = _rand(3 * 4096, 1)  # one "device" buffer, three objects back to back
    parts = [BufferHandle(ptr=int(staging.ctypes.data) + k * 4096, length=4096,
                          device="cuda", owner=staging) for k in range(3)]
    # objects 0 and 1 adjacent in the segment too; object 2 elsewhere
    jobs = [(parts[0], peer.segment_id, 8192, 4096), (parts[1], peer.segment_id, 12288, 4096),
            (parts[2], peer.segment_id, 65536, 4096)]
    assert e.copy_gpu_shm(jobs, write=True)
    assert cuda_double.async_sizes == [8192, 4096]  # 0+1 merged
    assert len(cuda_double.syncs) == 1
    assert len(cuda_double.registered) == 1  # the mapping, page-locked once
    assert peer.crc(8192, 8192) == zlib.crc32(staging[:8192].tobytes())
    assert peer.crc(65536, 4096) == zlib.crc32(staging[8192:].tobytes())
    back = np.zeros(3 * 4096, np.uint8)
    outs = [BufferHandle(ptr=int(back.ctypes.data) + k * 4096, length=4096, device="cuda",
                         owner=back) for k in range(3)]
    cuda_double.async_sizes.clear()
    assert e.copy_gpu_shm([(o, sid, off, n) for o, (_p, sid, off, n) in zip(outs, jobs,
                                                                              strict=True)],
                          write=False)
    assert cuda_double.async_sizes == [8192, 4096]
    assert np.array_equal(back, staging)
    assert len(cuda_double.registered) == 1


def test_out_of_range_raises_before_any_copy(cuda_double: HostCudaDouble, make_engine: Any,
                                             make_peer: Any) -> None:
    peer = make_peer(1 << 20)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    src = _device_buffer(_rand(8192, 2))
    before = peer.crc(0, 1 << 20)
    with pytest.raises(TransferError) as info:
        e.copy_gpu_shm([(src, peer.segment_id, 0, 4096),
                        (src, peer.segment_id, (1 << 20) - 4096, 8192)], write=True)
    assert info.value.code == ErrorCode.OUT_OF_BOUNDS
    assert cuda_double.async_copies == []
    assert peer.crc(0, 1 << 20) == before


def test_not_taken_when_it_does_not_apply(cuda_double: HostCudaDouble, make_engine: Any,
                                          make_peer: Any) -> None:
    peer = make_peer(1 << 20)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    data = _rand(4096, 3)
    host = BufferHandle(ptr=int(data.ctypes.data), length=4096, array=data)
    assert not e.copy_gpu_shm([(host, peer.segment_id, 0, 4096)], write=True)  # host memory
    assert not e.copy_gpu_shm([(_device_buffer(data), "no-such-segment", 0, 4096)], write=True)
    other = make_peer(1 << 20, host_id="host-elsewhere")
    e.add_peer_segment(other.desc)  # another host: not shm
    assert not e.copy_gpu_shm([(_device_buffer(data), other.segment_id, 0, 4096)], write=True)
    tcp_first = make_engine("host-test", {"rules": [{"name": "gpu-tcp", "device": "cuda",
                                                     "transports": ["tcp", "shm"]}]})
    tcp_first.add_peer_segment(peer.desc)
    assert not tcp_first.copy_gpu_shm([(_device_buffer(data), peer.segment_id, 0, 4096)],
                                      write=True)
    assert cuda_double.async_copies == []
