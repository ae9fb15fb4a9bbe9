"""A TEST DOUBLE of the CUDA runtime for GPU code paths on machines without
a GPU (this one): "device" memory is host memory and a cudaMemcpy is a
memmove. A test through it proves the bookkeeping around the DMA
(registration, staging, directions, offsets, streams, merged ranges), never
GPU behaviour; the real thing runs on a GPU machine (tests marked ``gpu``,
scripts/gpu_check*.py)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.transfer import gpu as gpu_mod
from kvpool.transfer.gpu import CudaRuntime

__all__ = ["HostCudaDouble", "cuda_double"]


class HostCudaDouble(CudaRuntime):
    """Fake CUDA runtime for a machine without a GPU (named as such)."""

    def __init__(self) -> None:
        super().__init__("host-double", None)
        self.registered: dict[int, int] = {}
        self.copies = 0
        self.devices: list[int] = []
        self.async_copies: list[int] = []  # the stream of each asynchronous copy
        self.async_sizes: list[int] = []  # and its length in bytes
        self.rows_2d = 0
        self.syncs: list[int] = []
        self.side_threads: set[int] = set()
        self.device_memory: dict[int, np.ndarray] = {}

    def set_device(self, index: int) -> None:
        self.devices.append(index)

    def memcpy(self, dst: int, src: int, n: int) -> None:
        self.copies += 1
        ctypes.memmove(dst, src, n)

    def host_register(self, ptr: int, n: int) -> None:
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = n

    def host_unregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def device_count(self) -> int:
        return 1

    # streams: the double's copies complete at once; it records which stream ran them
    def side_stream(self, device: int) -> int:
        self.side_threads.add(threading.get_ident())
        return 1000 + device

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self.async_copies.append(stream)
        self.async_sizes.append(n)
        ctypes.memmove(dst, src, n)

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, stream: int) -> None:
        assert dpitch >= width and spitch >= width
        self.async_copies.append(stream)
        self.rows_2d += height
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def stream_synchronize(self, stream: int) -> None:
        self.syncs.append(stream)

    def malloc(self, n: int, device: int) -> int:
        arr = np.zeros(n, np.uint8)
        self.device_memory[int(arr.ctypes.data)] = arr
        return int(arr.ctypes.data)

    def free(self, ptr: int) -> None:
        del self.device_memory[ptr]


@pytest.fixture
def cuda_double(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostCudaDouble]:
    rt = HostCudaDouble()
    monkeypatch.setattr(gpu_mod, "_cached", (rt, ""))
    yield rt
