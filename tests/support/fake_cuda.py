"""A stand-in for the CUDA runtime, for tests of GPU code paths on machines
without a GPU (this one). Its "device memory" is host memory and a
cudaMemcpyAsync is a memmove: what such a test checks is everything around
the DMA, never GPU behaviour itself."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from kvpool.transfer import gpu

__all__ = ["FakeCudaRuntime", "fake_cuda"]


class FakeCudaRuntime:
    """A stand-in for the CUDA runtime (no GPU here): copies are memmoves."""

    backend = "fake"

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int, int]] = []
        self.syncs: list[int] = []
        self.registered: list[tuple[int, int]] = []

    def set_device(self, index: int) -> None:
        assert index == 0

    def side_stream(self, device: int) -> int:
        return 7

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self.copies.append((dst, src, n, stream))
        ctypes.memmove(dst, src, n)

    def stream_synchronize(self, stream: int) -> None:
        self.syncs.append(stream)

    def host_register(self, ptr: int, n: int) -> None:
        self.registered.append((ptr, n))

    def host_unregister(self, ptr: int) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaRuntime]:
    rt = FakeCudaRuntime()
    monkeypatch.setattr(gpu, "_cached", (rt, ""))
    yield rt
