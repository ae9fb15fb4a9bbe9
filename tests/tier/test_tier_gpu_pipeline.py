"""The pipelined GPU staging of the ``posix`` transport (GPU buffer <-> file
segment through pinned bounce buffers, file I/O of one chunk overlapping the
cudaMemcpy of the next) on this CPU-only machine, through HostCudaDouble, the
TEST DOUBLE of the CUDA runtime from tests/transfer/test_gpu_double.py
("device" memory is host memory, cudaMemcpy is memmove). It proves the
chunking, ordering, overlap and buffer bookkeeping, not the DMA; the real
thing is test_tier_gpu.py and scripts/gpu_check_tier.py on a GPU machine."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from tier_helpers import pattern

from kvpool.core.errors import ErrorCode
from kvpool.transfer import TransferOp, TransferRequest
from kvpool.transfer import gpu as gpu_mod
from kvpool.transfer.file_segment import FileIO, FileSegment

KiB = 1 << 10
CHUNK = 64 * KiB


def _load_double() -> type:
    path = os.path.join(os.path.dirname(__file__), os.pardir, "transfer", "test_gpu_double.py")
    spec = importlib.util.spec_from_file_location("kvpool_tests_gpu_double", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.HostCudaDouble  # type: ignore[no-any-return]


HostCudaDouble = _load_double()


class _Recorder:
    """Wraps FileIO.read/write: slows each call a little (a disk takes time)
    and records which chunk ran and how many file I/Os were in flight when
    each cudaMemcpy of the double happened."""

    def __init__(self, delay_s: float = 0.02, fail_at: int | None = None) -> None:
        self.delay_s = delay_s
        self.fail_at = fail_at  # file offset whose write fails
        self.lock = threading.Lock()
        self.inflight = 0
        self.io: list[tuple[str, int, int]] = []
        self.overlap_at_copy: list[int] = []
        self.max_inflight = 0  # most file I/Os running at once (read-ahead depth)

    def wrap(self, name: str, orig: Any) -> Any:
        def call(fio: FileIO, off: int, buf: Any) -> None:
            with self.lock:
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                time.sleep(self.delay_s)
                if name == "write" and off == self.fail_at:
                    raise OSError(28, "No space left on device (injected)")
                orig(fio, off, buf)
                with self.lock:
                    self.io.append((name, off, len(buf)))
            finally:
                with self.lock:
                    self.inflight -= 1
        return call


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    r = _Recorder()
    rt = HostCudaDouble()
    orig_memcpy = rt.memcpy

    def memcpy(dst: int, src: int, n: int) -> None:
        with r.lock:
            r.overlap_at_copy.append(r.inflight)
        orig_memcpy(dst, src, n)

    rt.memcpy = memcpy
    r.rt = rt  # type: ignore[attr-defined]
    monkeypatch.setattr(gpu_mod, "_cached", (rt, ""))
    monkeypatch.setattr(FileIO, "write", r.wrap("write", FileIO.write))
    monkeypatch.setattr(FileIO, "read", r.wrap("read", FileIO.read))
    yield r


def _engine(make_engine: Any, depth: int, buffers: int = 4) -> Any:
    return make_engine(overrides={"transports": {"posix": {
        "staging_size": CHUNK, "staging_buffers": buffers,
        "options": {"pipeline_depth": depth}}}})


@pytest.mark.parametrize("depth", [1, 3])
def test_gpu_write_read_pipelined_through_double(make_engine: Any, tmp_path: Any,
                                                 rec: _Recorder, depth: int) -> None:
    n = 9 * CHUNK + 123  # 10 chunks, the last one partial
    off = 4096 * 3 + 7  # unaligned file offset
    engine = _engine(make_engine, depth)
    seg = FileSegment.open(str(tmp_path), 2 << 20)
    try:
        engine.add_local_segment(seg)
        data = pattern(21, n)
        fake_dev = np.zeros(n + 64, np.uint8)  # "device" memory of the double
        fake_dev[64:] = data
        src = engine.register_buffer((int(fake_dev.ctypes.data), n + 64), device="cuda")
        assert src.is_gpu
        st = engine.transfer([TransferRequest(TransferOp.WRITE, src, seg.segment_id, off, n,
                                              buffer_offset=64, transport="posix")], 30)
        assert st[0].ok, st[0].errors
        back = np.empty(n, np.uint8)
        seg.read_into(off, back)
        assert zlib.crc32(back.data) == zlib.crc32(data.data)
        writes = sorted(x for x in rec.io if x[0] == "write")
        # every chunk written exactly once, back to back, chunk-sized but the last
        assert [w[1] for w in writes] == [seg.base_offset + off + i * CHUNK for i in range(10)]
        assert [w[2] for w in writes] == [CHUNK] * 9 + [123]
        write_overlap = list(rec.overlap_at_copy)

        rec.io.clear()
        rec.overlap_at_copy.clear()
        rec.max_inflight = 0
        copies_before = rec.rt.copies  # type: ignore[attr-defined]
        dev_back = np.zeros(n, np.uint8)
        dst = engine.register_buffer((int(dev_back.ctypes.data), n), device="cuda")
        st = engine.transfer([TransferRequest(TransferOp.READ, dst, seg.segment_id, off, n,
                                              transport="posix")], 30)
        assert st[0].ok, st[0].errors
        assert (dev_back == data).all()
        assert rec.rt.copies - copies_before == 10  # type: ignore[attr-defined]
        reads = [x for x in rec.io if x[0] == "read"]
        assert sorted(r[1] for r in reads) == [seg.base_offset + off + i * CHUNK
                                               for i in range(10)]
        pool = engine.transport("posix")._pool
        assert sorted(pool._free) == [0, 1, 2, 3]  # every staging buffer back in the pool
        if depth == 1:
            # serial bounce: no cudaMemcpy ever runs while a file I/O is in flight
            assert max(write_overlap) == 0 and max(rec.overlap_at_copy) == 0
        else:
            # pipelined writes: copies ran while the I/O of other chunks was in flight;
            # pipelined reads: several chunks were read ahead at once (whether a copy
            # then meets one still running depends on thread timing, so not asserted)
            assert max(write_overlap) >= 1 and rec.max_inflight >= 2
            assert max(write_overlap) <= depth - 1  # never more I/O than free buffers allow
            assert rec.max_inflight <= depth
    finally:
        seg.close()


def test_gpu_write_failure_midway_releases_buffers_after_io(make_engine: Any, tmp_path: Any,
                                                            rec: _Recorder) -> None:
    engine = _engine(make_engine, depth=3)
    seg = FileSegment.open(str(tmp_path), 2 << 20)
    try:
        engine.add_local_segment(seg)
        rec.fail_at = seg.base_offset + 2 * CHUNK  # the third chunk's write fails
        n = 8 * CHUNK
        fake_dev = pattern(5, n)
        src = engine.register_buffer((int(fake_dev.ctypes.data), n), device="cuda")
        st = engine.transfer([TransferRequest(TransferOp.WRITE, src, seg.segment_id, 0, n,
                                              transport="posix")], 30)
        assert not st[0].ok
        assert st[0].code == ErrorCode.TRANSFER_FAIL, st[0].errors
        assert "injected" in st[0].errors[-1]
        assert rec.inflight == 0  # no staged I/O outlives the report
        pool = engine.transport("posix")._pool
        assert sorted(pool._free) == [0, 1, 2, 3]
        # the transport still serves: the same request succeeds once the disk recovers
        rec.fail_at = None
        st = engine.transfer([TransferRequest(TransferOp.WRITE, src, seg.segment_id, 0, n,
                                              transport="posix")], 30)
        assert st[0].ok, st[0].errors
        back = np.empty(n, np.uint8)
        seg.read_into(0, back)
        assert (back == fake_dev).all()
    finally:
        seg.close()


class _FakeKvikioDefaults:
    """Stands in for ``kvikio.defaults`` (kvikio cannot do I/O on this
    CPU-only machine): the get/set API of kvikio 26.x."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.sets: list[int] = []

    def get(self, name: str) -> int:
        assert name == "num_threads"
        return self.threads

    def set(self, name: str, value: int) -> None:
        assert name == "num_threads"
        self.sets.append(value)
        self.threads = value


@pytest.mark.parametrize(("have", "want", "expect", "sets"),
                         [(1, 4, 4, [4]), (16, 4, 16, []), (4, 4, 4, [])])
def test_gds_raises_kvikio_threads_never_lowers(have: int, want: int, expect: int,
                                                sets: list[int]) -> None:
    from types import SimpleNamespace

    from kvpool.transfer.transports.gds import _raise_threads

    d = _FakeKvikioDefaults(have)
    assert _raise_threads(SimpleNamespace(defaults=d), want) == expect
    assert d.sets == sets
    assert _raise_threads(SimpleNamespace(), want) is None  # no such setting: reported, no raise
