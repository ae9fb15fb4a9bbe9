"""posix / gds transports over file segments through the TransferEngine:
own segments, a same-host peer's segment file, another host's (tcp), failover."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import pytest
from tier_helpers import aligned_empty, pattern

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.transfer import RequestState, TransferOp, TransferRequest
from kvpool.transfer.file_segment import FileSegment
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
from kvpool.transfer.transports.gds import kvikio_status
from kvpool.transfer.transports.posix import PosixTransport
from kvpool.transfer.types import TransferError

MiB = 1 << 20
SIZES = [1, 3, 4095, 4097, 65_537, MiB + 7, 16 * MiB + 1, 64 * MiB]


@pytest.fixture
def seg(tmp_path):
    s = FileSegment.open(str(tmp_path / "disk"), 64 * MiB + 3 * 4096)
    yield s
    s.close()


def _write_read(engine, segment_id: str, off: int, data: np.ndarray) -> tuple[str, str]:
    n = data.size
    src = np.empty(n + 5, np.uint8)
    src[5:] = data  # buffer_offset 5: unaligned buffer range
    st = engine.transfer([TransferRequest(TransferOp.WRITE, src, segment_id, off, n,
                                          buffer_offset=5)], timeout=60)
    assert st[0].ok, st[0].errors
    dst = np.zeros(n + 3, np.uint8)
    rt = engine.transfer([TransferRequest(TransferOp.READ, dst, segment_id, off, n,
                                          buffer_offset=3)], timeout=60)
    assert rt[0].ok, rt[0].errors
    assert zlib.crc32(dst[3:].data) == zlib.crc32(data.data)
    return str(st[0].transport), str(rt[0].transport)


@pytest.mark.parametrize("size", SIZES)
def test_posix_own_segment_unaligned_checksums(make_engine, seg, size):
    engine = make_engine()
    engine.add_local_segment(seg)
    off = 4096 + 11 if size < 64 * MiB else 7
    used = _write_read(engine, seg.segment_id, off, pattern(size, size))
    assert used == ("posix", "posix")


def test_posix_batch_of_many_objects(make_engine, seg):
    engine = make_engine()
    engine.add_local_segment(seg)
    datas = [pattern(i, 1000 + 977 * i) for i in range(40)]
    offs, off = [], 0
    for d in datas:
        offs.append(off)
        off += d.size + 13
    h = engine.submit([TransferRequest(TransferOp.WRITE, d, seg.segment_id, o, d.size)
                       for d, o in zip(datas, offs, strict=True)])
    assert h.wait(30) and h.ok
    outs = [np.empty(d.size, np.uint8) for d in datas]
    h = engine.submit([TransferRequest(TransferOp.READ, b, seg.segment_id, o, b.size)
                       for b, o in zip(outs, offs, strict=True)])
    assert h.wait(30) and h.ok
    for d, b in zip(datas, outs, strict=True):
        assert np.array_equal(d, b)


def test_posix_aligned_requests_take_o_direct(make_engine, seg):
    engine = make_engine()
    engine.add_local_segment(seg)
    src = aligned_empty(4 * MiB)
    src[:] = pattern(3, src.size)
    direct_before = seg.io.direct_ops
    assert engine.transfer([TransferRequest(TransferOp.WRITE, src, seg.segment_id, 8192,
                                            src.size)], 30)[0].ok
    dst = aligned_empty(4 * MiB)
    assert engine.transfer([TransferRequest(TransferOp.READ, dst, seg.segment_id, 8192,
                                            dst.size)], 30)[0].ok
    assert seg.io.direct_ops == direct_before + 2
    assert np.array_equal(src, dst)


def test_same_host_peer_file_via_posix(make_engine, make_file_peer, tmp_path):
    """A file segment owned by another process on this host: posix opens its
    file by path (after checking the header) and does the I/O itself."""
    peer = make_file_peer(str(tmp_path / "peer"), 8 * MiB, host_id="host-tier")
    engine = make_engine(host_id="host-tier")
    engine.add_peer_segment(peer.desc)
    data = pattern(77, 3 * MiB + 5)
    used = _write_read(engine, peer.desc.segment_id, 1234, data)
    assert used == ("posix", "posix")
    assert peer.crc(1234, data.size) == zlib.crc32(data.data)
    assert isinstance(engine.transport("posix"), PosixTransport)
    assert engine.transport("posix").stats()["open_peer_files"] == 1  # type: ignore[union-attr]


def test_peer_file_with_wrong_header_is_refused(make_engine, make_file_peer, tmp_path):
    peer = make_file_peer(str(tmp_path / "peer"), 2 * MiB, host_id="host-tier")
    engine = make_engine(host_id="host-tier", overrides={"rules": [
        {"name": "f", "kind": "file", "transports": ["posix"]}]})
    d = peer.desc
    forged = SegmentDescriptor(segment_id="someone-else", client_id=d.client_id,
                               host_id=d.host_id, kind=SegmentKind.FILE, size=d.size, name=d.name,
                               endpoint=d.endpoint, base_offset=d.base_offset)
    engine.add_peer_segment(forged)
    st = engine.transfer([TransferRequest(TransferOp.WRITE, b"x" * 10, "someone-else", 0, 10)],
                         10)
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.SEGMENT_MISMATCH
    assert peer.crc(0, 10) == zlib.crc32(bytes(10))  # nothing written


def test_remote_file_segment_goes_through_tcp(make_engine, make_file_peer, tmp_path):
    """Another host's file segment: the owner's transfer server does the file I/O."""
    peer = make_file_peer(str(tmp_path / "remote"), 80 * MiB, host_id="other-host")
    engine = make_engine(host_id="host-tier")
    engine.add_peer_segment(peer.desc)
    for size, off in ((1, 0), (4097, 9999), (16 * MiB + 1, 3), (64 * MiB, 4096 + 5)):
        data = pattern(size + 1, size)
        assert _write_read(engine, peer.desc.segment_id, off, data) == ("tcp", "tcp")
        assert peer.crc(off, size) == zlib.crc32(data.data)


def test_full_file_segment_bounds_through_engine(make_engine, tmp_path):
    seg = FileSegment.open(str(tmp_path), MiB)
    try:
        engine = make_engine()
        engine.add_local_segment(seg)
        ok = engine.transfer([TransferRequest(TransferOp.WRITE, pattern(1, MiB),
                                              seg.segment_id, 0, MiB)], 10)
        assert ok[0].ok
        st = engine.transfer([TransferRequest(TransferOp.WRITE, b"abc", seg.segment_id,
                                              MiB - 2, 3)], 10)
        assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.OUT_OF_BOUNDS
    finally:
        seg.close()


def test_gds_unavailable_here_with_reason(make_engine):
    mod, reason = kvikio_status()
    if mod is not None:
        pytest.skip("kvikio is usable on this machine (GPU + driver): covered by the gpu check")
    engine = make_engine()
    usable, why = engine.transports()["gds"]
    assert usable is False
    assert why == reason
    assert "kvikio" in why and ("libcuda.so.1" in why or "not installed" in why
                                or "CUDA" in why)


class _FailingGds(Transport):
    """Test-only stand-in named ``gds`` that fails every request retryably
    (this machine has no CUDA driver, so the real gds cannot run here)."""

    name = "gds"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return kind == SegmentKind.FILE and same_host

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        self.calls += 1
        for it in items:
            report(it, TransferError("simulated cuFile failure", ErrorCode.TRANSFER_FAIL))


def test_failover_gds_to_posix(make_engine, seg):
    engine = make_engine(overrides={"rules": [
        {"name": "file", "kind": "file", "same_host": True, "transports": ["gds", "posix"]}]})
    fake = _FailingGds()
    engine.register_transport(fake)
    engine.add_local_segment(seg)
    data = pattern(42, 2 * MiB + 3)
    st = engine.transfer([TransferRequest(TransferOp.WRITE, data, seg.segment_id, 100,
                                          data.size)], 30)
    assert st[0].ok and st[0].transport == "posix"
    assert st[0].errors and st[0].errors[0].startswith("gds: ")
    out = np.empty(data.size, np.uint8)
    seg.read_into(100, out)
    assert np.array_equal(out, data)
    assert fake.calls >= 1
