"""GPU buffers <-> same-host shm segments through the engine's shm transport.

This machine has no GPU: :class:`support.cuda_double.HostCudaDouble` stands
in for the CUDA runtime (hardware this machine lacks). Its "device memory" is
host memory and a cudaMemcpyAsync is a memmove, so what is tested here for real is
everything around the DMA: a real peer process's shm segment mapped and
registered once, range checks, adjacent ranges merged into one copy, one
wait per batch, the selector's say. The same paths on a real GPU:
tests/transfer/test_gpu.py (run on the H200).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.transfer.buffers import BufferHandle
from kvpool.transfer.types import TransferOp, TransferRequest
from support.cuda_double import HostCudaDouble

R, W = TransferOp.READ, TransferOp.WRITE


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
    where = [8192, 12288, 65536]
    st = e.transfer([TransferRequest(W, p, peer.segment_id, off, 4096)
                     for p, off in zip(parts, where, strict=True)], 5)
    assert all(x.ok and x.transport == "shm" for x in st), st
    assert cuda_double.async_sizes == [8192, 4096]  # 0+1 merged
    assert len(cuda_double.syncs) == 1
    assert len(cuda_double.registered) == 1  # the mapping, page-locked once
    assert peer.crc(8192, 8192) == zlib.crc32(staging[:8192].tobytes())
    assert peer.crc(65536, 4096) == zlib.crc32(staging[8192:].tobytes())
    back = np.zeros(3 * 4096, np.uint8)
    outs = [BufferHandle(ptr=int(back.ctypes.data) + k * 4096, length=4096, device="cuda",
                         owner=back) for k in range(3)]
    cuda_double.async_sizes.clear()
    st = e.run([TransferRequest(R, o, peer.segment_id, off, 4096)
                for o, off in zip(outs, where, strict=True)], 5)
    assert all(x.ok for x in st)
    assert cuda_double.async_sizes == [8192, 4096]
    assert np.array_equal(back, staging)
    assert len(cuda_double.registered) == 1


def test_out_of_range_fails_alone_before_any_copy(cuda_double: HostCudaDouble,
                                                  make_engine: Any, make_peer: Any) -> None:
    peer = make_peer(1 << 20)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    src = _device_buffer(_rand(8192, 2))
    before = peer.crc(4096, (1 << 20) - 4096)
    st = e.transfer([TransferRequest(W, src, peer.segment_id, 0, 4096),
                     TransferRequest(W, src, peer.segment_id, (1 << 20) - 4096, 8192)], 5)
    assert st[0].ok and st[1].code == ErrorCode.OUT_OF_BOUNDS, st
    assert cuda_double.async_sizes == [4096]  # the refused one never reached CUDA
    assert peer.crc(0, 4096) == zlib.crc32(_rand(8192, 2)[:4096].tobytes())
    assert peer.crc(4096, (1 << 20) - 4096) == before


def test_only_gpu_buffers_to_same_host_memory_take_cuda(cuda_double: HostCudaDouble,
                                                        make_engine: Any,
                                                        make_peer: Any) -> None:
    """Host buffers copy on the host; a segment of another host goes over tcp
    (staged); a rule that puts tcp first for GPU buffers is obeyed."""
    peer = make_peer(1 << 20)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    data = _rand(4096, 3)
    host = BufferHandle(ptr=int(data.ctypes.data), length=4096, array=data)
    (st,) = e.transfer([TransferRequest(W, host, peer.segment_id, 0, 4096)], 5)
    assert st.ok and st.transport == "shm" and cuda_double.async_copies == []
    (st,) = e.transfer([TransferRequest(W, _device_buffer(data), "no-such-segment", 0, 4096)],
                       5)
    assert st.code == ErrorCode.SEGMENT_NOT_FOUND
    tcp_first = make_engine("host-test", {"rules": [{"name": "gpu-tcp", "device": "cuda",
                                                     "transports": ["tcp", "shm"]}]})
    tcp_first.add_peer_segment(peer.desc)
    (st,) = tcp_first.transfer([TransferRequest(W, _device_buffer(data), peer.segment_id,
                                                8192, 4096)], 5)
    assert st.ok and st.transport == "tcp", st
    assert cuda_double.async_copies == []
    assert peer.crc(8192, 4096) == zlib.crc32(data.tobytes())
