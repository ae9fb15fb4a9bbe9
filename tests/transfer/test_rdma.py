"""The ``rdma`` transport's hardware-independent parts.

Messages, options, planning and completion mapping are tested directly; the
data path, connection setup and failover run through real TransferEngines
(real transfer servers and tcp over loopback, real shm segments, real peer
processes) with the verbs layer replaced by LoopbackVerbsDouble, a fake of
the RDMA hardware this machine lacks (tests/support/verbs_double.py).
"""

from __future__ import annotations

import ctypes
import logging
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentDescriptor
from kvpool.transfer import (
    MemorySegment,
    RequestState,
    TransferEngine,
    TransferOp,
    TransferRequest,
    load_transfer_config,
)
from kvpool.transfer.config import TransportSettings
from kvpool.transfer.rdma_proto import (
    MAX_QPS_PER_CONNECT,
    MAX_SEGMENTS_PER_CONNECT,
    OP_RDMA_CONNECT,
    ConnectReply,
    ConnectRequest,
    QpInfo,
    SegmentMr,
)
from kvpool.transfer.rdma_verbs import Completion, PyverbsVerbs, WcStatus
from kvpool.transfer.transports.rdma import (
    PlannedSge,
    RdmaOptions,
    RdmaTransport,
    WrPiece,
    completion_error,
    plan_work_requests,
)
from support.peer import fill_pattern
from support.verbs_double import LoopbackFabric, LoopbackVerbsDouble

GID = "fe80:0000:0000:0000:0000:0000:0000:0001"
KiB = 1 << 10


# -- QP-info messages --------------------------------------------------------------------


def test_connect_messages_roundtrip_through_msgpack() -> None:
    req = ConnectRequest("c-1", "host-a", [QpInfo(0x1234, 77, 3, GID, 4096),
                                           QpInfo(0xFFFFFF, 0, 0, GID, 1024)], ["s1", "s2"], 9)
    wire = msgpack.unpackb(msgpack.packb(req.to_wire(), use_bin_type=True), raw=False)
    assert wire["op"] == OP_RDMA_CONNECT
    back = ConnectRequest.from_wire(wire)
    assert back == req
    rep = ConnectReply(9, ErrorCode.OK, "", [QpInfo(5, 6, 7, GID, 2048)],
                       [SegmentMr("s1", 0x7F0000001000, 0xABCD, 1 << 30)])
    rwire = msgpack.unpackb(msgpack.packb(rep.to_wire(), use_bin_type=True), raw=False)
    assert ConnectReply.from_wire(rwire) == rep
    # an error reply carries its code and message only
    err = ConnectReply.from_wire({"id": 3, "code": int(ErrorCode.UNKNOWN_OP), "err": "nope"})
    assert err.code == ErrorCode.UNKNOWN_OP and err.err == "nope" and not err.qps


def test_largest_connect_request_fits_the_transfer_server_header_limit() -> None:
    qps = [QpInfo(0xFFFFFF, 0xFFFFFF, 0xFFFF, GID, 4096)] * MAX_QPS_PER_CONNECT
    segs = ["s" * 64] * MAX_SEGMENTS_PER_CONNECT
    req = ConnectRequest("c" * 64, "h" * 64, qps, segs, (1 << 63))
    assert len(msgpack.packb(req.to_wire(), use_bin_type=True)) < 4096


@pytest.mark.parametrize("bad", [
    {"qps": [[0, 1, 1, GID, 4096]]},                        # qp_num 0
    {"qps": [[1 << 24, 1, 1, GID, 4096]]},                  # qp_num > 24 bits
    {"qps": [[1, -1, 1, GID, 4096]]},                       # negative psn
    {"qps": [[1, 1, 1 << 16, GID, 4096]]},                  # lid > 16 bits
    {"qps": [[1, 1, 1, "fe80::1", 4096]]},                  # gid not in pyverbs' form
    {"qps": [[1, 1, 1, GID, 3000]]},                        # mtu not an IB MTU
    {"qps": [[1, 1, 0, "0000:0000:0000:0000:0000:0000:0000:0000", 4096]]},  # unreachable
    {"qps": [[1, 1, 1, GID]]},                              # short entry
    {"qps": [[True, 1, 1, GID, 4096]]},                     # bool is not an int
    {"qps": [[1, 1, 1, GID, 4096]] * (MAX_QPS_PER_CONNECT + 1)},
    {"segs": ["x"] * (MAX_SEGMENTS_PER_CONNECT + 1)},
    {"segs": [7]},
    {"conn": ""},
    {"conn": "c" * 65},
    {"qps": [], "segs": []},                                # asks for nothing
    {"op": 1},
    {"id": "x"},
])
def test_connect_request_validation(bad: dict[str, Any]) -> None:
    base = ConnectRequest("c", "h", [QpInfo(1, 1, 1, GID, 4096)], ["s"]).to_wire()
    base.update(bad)
    with pytest.raises(KVPoolError) as ei:
        ConnectRequest.from_wire(base)
    assert ei.value.code == ErrorCode.MALFORMED_FRAME


def test_connect_request_version_mismatch_is_invalid_version() -> None:
    wire = ConnectRequest("c", "h", [], ["s"]).to_wire() | {"v": 2}
    with pytest.raises(KVPoolError) as ei:
        ConnectRequest.from_wire(wire)
    assert ei.value.code == ErrorCode.INVALID_VERSION


@pytest.mark.parametrize("seg", [["s", 0, 1, 1], ["s", 1, -1, 1], ["s", 1, 1 << 32, 1],
                                 ["s", (1 << 64) - 10, 1, 100], ["s", 1, 1]])
def test_segment_mr_validation(seg: list[Any]) -> None:
    with pytest.raises(KVPoolError):
        ConnectReply.from_wire({"id": 1, "code": 0, "err": "", "qps": [], "segs": [seg]})


# -- options -----------------------------------------------------------------------------


def test_options_from_the_shipped_yaml_and_validation() -> None:
    cfg = load_transfer_config()
    opts = RdmaOptions.from_options(cfg.settings_for("rdma").options)
    assert opts.qp_depth >= 1 and opts.max_wr_bytes >= 4096 and opts.qps_per_peer >= 1
    o = RdmaOptions.from_options({"devices": "mlx5_0", "max_wr_bytes": "256KiB", "mtu": 1024})
    assert o.devices == ["mlx5_0"] and o.max_wr_bytes == 256 * KiB
    for bad in ({"nope": 1}, {"mtu": 1500}, {"qp_depth": 0}, {"max_wr_bytes": 100},
                {"max_sge": 0}, {"qps_per_peer": 17}, {"port": 0}, {"devices": [1]}):
        with pytest.raises(ConfigError):
            RdmaOptions.from_options(bad)
    # a bad option fails engine startup, like every other config error
    with pytest.raises(ConfigError):
        TransferEngine(load_transfer_config(overrides={
            "transports": {"rdma": {"options": {"qp_depht": 8}}}}), "h")


# -- planning ----------------------------------------------------------------------------


def test_plan_splits_large_requests_at_max_wr_bytes() -> None:
    p = WrPiece(0, TransferOp.WRITE, 0x10000, 7, 10 * KiB, 0x5000, 3)
    plan = plan_work_requests([p], 4 * KiB, 4)
    assert [w.length for w in plan] == [4 * KiB, 4 * KiB, 2 * KiB]
    assert [w.remote_addr for w in plan] == [0x10000, 0x11000, 0x12000]
    assert [w.sges[0].addr for w in plan] == [0x5000, 0x6000, 0x7000]
    assert all(w.rkey == 7 and w.sges[0].lkey == 3 and w.keys == [0] for w in plan)


def test_plan_gathers_remote_contiguous_requests_into_sges() -> None:
    # three local blocks scattered in memory, written to one contiguous remote range
    pieces = [WrPiece(i, TransferOp.WRITE, 0x100000 + i * KiB, 9, KiB, 0x9000 + i * 3 * KiB, 1)
              for i in range(3)]
    plan = plan_work_requests(pieces, 64 * KiB, 4)
    assert len(plan) == 1 and plan[0].length == 3 * KiB
    assert [(s.key, s.addr) for s in plan[0].sges] == [(0, 0x9000), (1, 0x9C00), (2, 0xA800)]
    # max_sge bounds the gather; so does max_wr_bytes
    assert [len(w.sges) for w in plan_work_requests(pieces, 64 * KiB, 2)] == [2, 1]
    assert [len(w.sges) for w in plan_work_requests(pieces, 2 * KiB, 4)] == [2, 1]
    # locally contiguous parts of one request extend one SGE rather than adding one
    one = plan_work_requests([WrPiece(0, TransferOp.READ, 0x0, 1, 8 * KiB, 0x4000, 1)],
                             8 * KiB, 4)
    assert len(one) == 1 and len(one[0].sges) == 1
    # ... and so do requests contiguous on both sides: 16 x 4 KiB -> one 64 KiB SGE
    blocks = [WrPiece(i, TransferOp.WRITE, 0x80000 + i * 4 * KiB, 2, 4 * KiB,
                      0x10000 + i * 4 * KiB, 1) for i in range(16)]
    merged = plan_work_requests(blocks, 64 * KiB, 1)
    assert len(merged) == 1 and merged[0].length == 64 * KiB
    assert merged[0].sges == [PlannedSge(0, 0, 64 * KiB, 0x10000, 1)]
    assert merged[0].keys == list(range(16))
    assert [w.keys for w in plan_work_requests(blocks, 32 * KiB, 1)] == \
        [list(range(8)), list(range(8, 16))]


def test_plan_keeps_apart_what_cannot_share_a_wr() -> None:
    a = WrPiece(0, TransferOp.WRITE, 0x1000, 5, KiB, 0x100000, 1)
    gap = WrPiece(1, TransferOp.WRITE, 0x1000 + 2 * KiB, 5, KiB, 0x200000, 1)
    other_key = WrPiece(2, TransferOp.WRITE, 0x1000 + KiB, 6, KiB, 0x300000, 1)
    read = WrPiece(3, TransferOp.READ, 0x1000 + KiB, 5, KiB, 0x400000, 1)
    for second in (gap, other_key, read):
        assert len(plan_work_requests([a, second], 64 * KiB, 8)) == 2
    staged = [WrPiece(i, TransferOp.WRITE, 0x1000 + i * KiB, 5, KiB, staged=True)
              for i in range(2)]
    plan = plan_work_requests(staged, 64 * KiB, 8, staged_max_bytes=512)
    assert len(plan) == 4 and all(w.staged and w.sges[0].addr == 0 for w in plan)
    assert plan_work_requests([WrPiece(0, TransferOp.WRITE, 1, 1, 0, 1, 1)], KiB, 1) == []


# -- completion -> request status ---------------------------------------------------------


def test_completion_errors_are_retryable_with_a_mapped_code() -> None:
    e = completion_error(Completion(1, WcStatus.RETRY_EXC_ERR, 0x81))
    assert e.retryable and e.code == ErrorCode.TIMEOUT
    assert "RETRY_EXC_ERR" in str(e) and "0x81" in str(e)
    for st in (WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.LOC_PROT_ERR, 99):
        e = completion_error(Completion(1, int(st)))
        assert e.retryable and e.code == ErrorCode.TRANSFER_FAIL


# -- availability and the selector's fallback ---------------------------------------------


def test_rdma_unavailable_falls_back_to_tcp_with_one_log_line(
        make_peer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """With the shipped config the engine loads the real (pyverbs) rdma
    transport; here it is unavailable, logged once, and a remote-memory
    request (rule [rdma, tcp]) runs over tcp to a real peer process."""
    ok, reason = PyverbsVerbs().available()
    if ok:
        pytest.skip("an RDMA device is present: the fallback is not exercised here")
    assert reason.startswith("pyverbs not importable") or reason.startswith("no RDMA device")
    peer = make_peer(256 * KiB)
    peer.cmd("fill 5")
    with caplog.at_level(logging.INFO, logger="kvpool.transfer.selection"):
        eng = TransferEngine(load_transfer_config(), "host-local")
    try:
        lines = [r for r in caplog.records if "transport rdma skipped" in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0].getMessage()
        assert eng.transports()["rdma"] == (False, reason)
        eng.add_peer_segment(peer.desc)
        buf = np.zeros(100 * KiB, dtype=np.uint8)
        [st] = eng.transfer([TransferRequest(TransferOp.READ, buf, peer.desc.segment_id, 0,
                                             buf.nbytes)], timeout=10)
        assert st.state is RequestState.DONE and st.transport == "tcp" and not st.errors
        assert np.array_equal(buf, fill_pattern(5, 256 * KiB)[:100 * KiB])
    finally:
        eng.close()


def test_double_without_devices_reports_the_reason() -> None:
    t = RdmaTransport(verbs=LoopbackVerbsDouble(devices=()))
    assert t.available() == (False, "no RDMA device (loopback double configured without "
                                    "devices)")
    t2 = RdmaTransport(_settings(devices=["mlx5_9"]), verbs=LoopbackVerbsDouble())
    ok, reason = t2.available()
    assert not ok and "mlx5_9" in reason
    t.close()
    t2.close()


# -- engines over the double ---------------------------------------------------------------


def _settings(**options: Any) -> TransportSettings:
    opts = {"qp_depth": 8, "max_wr_bytes": "64KiB", "qps_per_peer": 2,
            "connect_timeout_s": 1.0} | options
    s = TransportSettings(timeout_s=5.0, retries=0, threads=1, staging_buffers=4,
                          staging_size=32 * KiB, pause_after_failures=3, cooldown_s=30.0,
                          options=opts)
    s.validate()
    return s


class Pair:
    """Engine A (host-a, the requester) and engine B (host-b, owns a 1 MiB shm
    segment), both with an rdma transport over one loopback fabric, plus
    their real transfer servers and tcp transports."""

    def __init__(self, settings: TransportSettings | None = None, describe: bool = True,
                 size: int = 1 << 20, cuda: Any = None) -> None:
        self.fabric = LoopbackFabric()
        cfg = load_transfer_config(overrides={"transports": {"tcp": {"retries": 0}}})
        self.a = TransferEngine(cfg, "host-a", client_id="a")
        self.b = TransferEngine(load_transfer_config(), "host-b", client_id="b")
        self.settings = settings or _settings()
        self.ra = RdmaTransport(self.settings, verbs=LoopbackVerbsDouble(self.fabric),
                                cuda=cuda)
        self.rb = RdmaTransport(self.settings, verbs=LoopbackVerbsDouble(self.fabric))
        self.a.register_transport(self.ra, self.settings)
        self.b.register_transport(self.rb, self.settings)
        self.seg = MemorySegment.create(f"rdma-{uuid.uuid4().hex[:8]}", size)
        self.desc = self.b.add_local_segment(self.seg)
        if describe:
            self.desc.extra.update(self.rb.describe_segment(self.seg))
        self.a.add_peer_segment(self.desc)

    @property
    def sid(self) -> str:
        return self.seg.segment_id

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.seg.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_write_and_read_over_rdma_registered_and_staged(pair: Pair) -> None:
    data = np.frombuffer(np.random.default_rng(1).bytes(300 * KiB), dtype=np.uint8).copy()
    reg = pair.a.register_buffer(data)           # registered: RDMA straight from it
    staged = bytearray(data[:70 * KiB].tobytes())  # unregistered: staged
    sts = pair.a.transfer([
        TransferRequest(TransferOp.WRITE, reg, pair.sid, 0, data.nbytes),
        TransferRequest(TransferOp.WRITE, staged, pair.sid, 512 * KiB, len(staged)),
    ], timeout=10)
    assert [(s.state, s.transport, s.errors) for s in sts] == \
        [(RequestState.DONE, "rdma", [])] * 2
    seg = pair.seg.array()
    assert np.array_equal(seg[:data.nbytes], data)
    assert seg[512 * KiB:512 * KiB + len(staged)].tobytes() == bytes(staged)
    # read back into a registered and an unregistered buffer, at buffer offsets
    out = np.zeros(400 * KiB, dtype=np.uint8)
    hout = pair.a.register_buffer(out)
    plain = np.zeros(80 * KiB, dtype=np.uint8)
    sts = pair.a.transfer([
        TransferRequest(TransferOp.READ, hout, pair.sid, 0, data.nbytes, buffer_offset=KiB),
        TransferRequest(TransferOp.READ, plain, pair.sid, 512 * KiB, 70 * KiB,
                        buffer_offset=10 * KiB),
    ], timeout=10)
    assert all(s.ok and s.transport == "rdma" for s in sts)
    assert np.array_equal(out[KiB:KiB + data.nbytes], data)
    assert plain[10 * KiB:80 * KiB].tobytes() == bytes(staged)
    st = pair.ra.stats()
    # 300 KiB at 64 KiB per WR = 5 WRs (x2: write + read); staged 70 KiB in 32 KiB slots = 3
    assert st["wrs_posted"] == 2 * (5 + 3)
    assert st["staged_bytes"] == 2 * 70 * KiB
    assert st["registered_buffers"] == 2 and st["connects"] == 1
    assert pair.fabric.max_outstanding_seen <= pair.settings.options["qp_depth"]
    assert pair.rb.stats()["accepted"] == 1 and pair.rb.stats()["registered_segments"] == 1
    # unregistering a buffer with the engine deregisters its MR
    n_mrs = len(pair.fabric.mrs)
    pair.a.unregister_buffer(reg)
    assert pair.ra.stats()["registered_buffers"] == 1 and len(pair.fabric.mrs) == n_mrs - 1


def test_scattered_blocks_are_gathered_into_multi_sge_wrs(pair: Pair) -> None:
    src = np.frombuffer(np.random.default_rng(2).bytes(64 * KiB), dtype=np.uint8).copy()
    h = pair.a.register_buffer(src)
    # 8 blocks of 4 KiB taken from every other 8 KiB of the buffer -> one 32 KiB object
    reqs = [TransferRequest(TransferOp.WRITE, h, pair.sid, 100 * KiB + i * 4 * KiB, 4 * KiB,
                            buffer_offset=i * 8 * KiB) for i in range(8)]
    assert all(s.ok for s in pair.a.transfer(reqs, timeout=10))
    expect = np.concatenate([src[i * 8 * KiB:i * 8 * KiB + 4 * KiB] for i in range(8)])
    assert np.array_equal(pair.seg.array()[100 * KiB:132 * KiB], expect)
    assert pair.fabric.sge_counts == [4, 4]  # max_sge 4: two WRs of four SGEs


def test_qp_depth_bounds_wrs_in_flight_for_many_small_requests() -> None:
    p = Pair(_settings(qp_depth=2, qps_per_peer=1, max_wr_bytes="4KiB", max_sge=1))
    try:
        buf = np.arange(200 * KiB, dtype=np.uint8)
        h = p.a.register_buffer(buf)
        [st] = p.a.transfer([TransferRequest(TransferOp.WRITE, h, p.sid, 0, buf.nbytes)],
                            timeout=10)
        assert st.ok and st.transport == "rdma"
        assert p.ra.stats()["wrs_posted"] == 50
        assert p.fabric.max_outstanding_seen == 2
        assert np.array_equal(p.seg.array()[:buf.nbytes], buf)
    finally:
        p.close()


def test_without_descriptor_extra_registrations_come_from_the_connect_reply() -> None:
    """A descriptor with no extra['rdma'] makes the requester ask the owner's
    transfer server, which does not route OP_RDMA_CONNECT (UNKNOWN_OP):
    rdma fails retryably and the request fails over to tcp."""
    p = Pair(describe=False)
    try:
        buf = np.full(10 * KiB, 7, dtype=np.uint8)
        [st] = p.a.transfer([TransferRequest(TransferOp.WRITE, buf, p.sid, 0, buf.nbytes)],
                            timeout=10)
        assert st.ok and st.transport == "tcp"
        assert len(st.errors) == 1 and st.errors[0].startswith("rdma:")
        assert "UNKNOWN_OP" in st.errors[0] and "no rdma connect listener" in st.errors[0]
        assert np.all(p.seg.array()[:buf.nbytes] == 7)
    finally:
        p.close()


def test_segment_info_is_queried_on_an_existing_connection(pair: Pair) -> None:
    """A second segment of the same owner, without extra['rdma']'s rkey, is
    learned through a query on the owner's connect endpoint."""
    seg2 = MemorySegment.create(f"rdma2-{uuid.uuid4().hex[:8]}", 64 * KiB)
    try:
        d2 = pair.b.add_local_segment(seg2)
        d2.extra["rdma"] = {"connect": pair.desc.extra["rdma"]["connect"]}
        pair.a.add_peer_segment(d2)
        buf = np.full(8 * KiB, 3, dtype=np.uint8)
        sts = pair.a.transfer([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, 8 * KiB),
                               TransferRequest(TransferOp.WRITE, buf, seg2.segment_id, 0,
                                               8 * KiB)], timeout=10)
        assert [(s.ok, s.transport) for s in sts] == [(True, "rdma")] * 2
        assert np.all(seg2.array()[:8 * KiB] == 3)
        assert pair.ra.stats()["connects"] == 1
    finally:
        pair.b.remove_local_segment(seg2.segment_id)
        seg2.close()


@pytest.mark.parametrize(("qps", "expect"), [
    # one QP: the WR after the failed one is flushed (QP in ERR) and fails over too
    (1, ["rdma", "rdma", "tcp", "tcp"]),
    # two QPs, WRs alternate: the fourth ran on the healthy QP and stays done
    (2, ["rdma", "rdma", "tcp", "rdma"]),
])
def test_completion_error_fails_over_to_tcp_and_reconnects(qps: int, expect: list[str]) -> None:
    pair = Pair(_settings(qps_per_peer=qps))
    try:
        _completion_error_case(pair, expect)
    finally:
        pair.close()


def _completion_error_case(pair: Pair, expect: list[str]) -> None:
    data = np.frombuffer(np.random.default_rng(3).bytes(256 * KiB), dtype=np.uint8).copy()
    h = pair.a.register_buffer(data)
    pair.fabric.fail_next(1, WcStatus.RETRY_EXC_ERR, skip=2)  # third WR fails mid-batch
    sts = pair.a.transfer([TransferRequest(TransferOp.WRITE, h, pair.sid, i * 64 * KiB,
                                           64 * KiB, buffer_offset=i * 64 * KiB)
                           for i in range(4)], timeout=10)
    assert all(s.ok for s in sts)
    assert [s.transport for s in sts] == expect
    assert "RETRY_EXC_ERR" in sts[2].errors[0] and sts[2].code == ErrorCode.OK
    if expect[3] == "tcp":
        assert "WR_FLUSH_ERR" in sts[3].errors[0]
    assert np.array_equal(pair.seg.array()[:data.nbytes], data)
    assert pair.ra.stats()["completion_errors"] >= 1
    # the broken connection was dropped; the next batch reconnects and uses rdma
    [st] = pair.a.transfer([TransferRequest(TransferOp.READ, h, pair.sid, 0, 64 * KiB)],
                           timeout=10)
    assert st.ok and st.transport == "rdma" and pair.ra.stats()["connects"] == 2


def test_repeated_completion_errors_pause_rdma_then_tcp_serves_directly(pair: Pair) -> None:
    buf = np.full(16 * KiB, 9, dtype=np.uint8)
    pair.fabric.fail_next(100, WcStatus.RETRY_EXC_ERR)
    for _ in range(pair.settings.pause_after_failures):
        [st] = pair.a.transfer([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, buf.nbytes)],
                               timeout=10)
        assert st.ok and st.transport == "tcp" and st.errors[0].startswith("rdma:")
    # paused: the selector skips rdma without trying it
    [st] = pair.a.transfer([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, buf.nbytes)],
                           timeout=10)
    assert st.ok and st.transport == "tcp" and st.errors == []
    assert np.all(pair.seg.array()[:buf.nbytes] == 9)


def test_stale_rkey_after_owner_deregisters_fails_over(pair: Pair) -> None:
    buf = np.full(8 * KiB, 4, dtype=np.uint8)
    [st] = pair.a.transfer([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, buf.nbytes)],
                           timeout=10)
    assert st.transport == "rdma"
    pair.rb.forget_segment(pair.sid)  # owner deregisters; A still holds the old rkey
    buf[:] = 5
    [st] = pair.a.transfer([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, buf.nbytes)],
                           timeout=10)
    assert st.ok and st.transport == "tcp" and "REM_ACCESS_ERR" in st.errors[0]
    assert np.all(pair.seg.array()[:buf.nbytes] == 5)


def test_stalled_wrs_hit_the_deadline_and_fail_over() -> None:
    s = _settings()
    s.timeout_s = 0.3
    p = Pair(s)
    try:
        buf = np.full(8 * KiB, 6, dtype=np.uint8)
        p.fabric.stall = True
        [st] = p.a.transfer([TransferRequest(TransferOp.WRITE, buf, p.sid, 0, buf.nbytes)],
                            timeout=10)
        assert st.ok and st.transport == "tcp" and "deadline" in st.errors[0]
        assert p.ra.stats()["timeouts"] == 1
        assert not p.ra.stats()["peers"][p.desc.extra["rdma"]["connect"]]["connected"]
    finally:
        p.close()


def test_unreachable_peer_is_skipped_after_repeated_connect_failures(make_peer: Any) -> None:
    """A real peer process whose transfer server cannot answer rdma connects:
    every request still completes over tcp, and after pause_after_failures
    connect failures the rdma transport stops trying that peer for a while."""
    peer = make_peer(128 * KiB)
    cfg = load_transfer_config(overrides={"transports": {"tcp": {"retries": 0}}})
    eng = TransferEngine(cfg, "host-a")
    peer_settings = _settings()
    peer_settings.pause_after_failures = 2  # the transport's per-peer threshold
    engine_settings = _settings()
    engine_settings.pause_after_failures = 100  # keep the engine from pausing all of rdma
    rdma = RdmaTransport(peer_settings, verbs=LoopbackVerbsDouble())
    try:
        eng.register_transport(rdma, engine_settings)
        eng.add_peer_segment(peer.desc)
        data = np.frombuffer(np.random.default_rng(4).bytes(64 * KiB), dtype=np.uint8).copy()
        for i in range(3):
            [st] = eng.transfer([TransferRequest(TransferOp.WRITE, data, peer.desc.segment_id,
                                                 i * KiB, data.nbytes)], timeout=10)
            assert st.ok and st.transport == "tcp"
            assert peer.crc(i * KiB, data.nbytes) == zlib.crc32(data.tobytes())
            if i < 2:
                assert "UNKNOWN_OP" in st.errors[0]
            else:
                assert "down for another" in st.errors[0]
        assert rdma.stats()["connect_failures"] == 2
    finally:
        eng.close()


# -- the owner's connect handler -----------------------------------------------------------


def test_connect_handler_refuses_bad_requests_and_keeps_serving(pair: Pair) -> None:
    h = pair.rb.handle_connect
    assert h({"op": OP_RDMA_CONNECT, "id": 4})["code"] == ErrorCode.INVALID_VERSION
    r = h(ConnectRequest("c", "x", [], ["no-such-segment"], 5).to_wire())
    assert r["code"] == ErrorCode.SEGMENT_NOT_FOUND and r["id"] == 5
    r = h(ConnectRequest("c", "x", [QpInfo(1, 1, 1, "zz", 4096)], []).to_wire())
    assert r["code"] == ErrorCode.MALFORMED_FRAME
    # over the real listener socket: garbage, then a valid query still answered
    ep = pair.desc.extra["rdma"]["connect"]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(ep)
        sock.send(b"\xc1not msgpack")
        assert msgpack.unpackb(sock.recv())["code"] == ErrorCode.MALFORMED_FRAME
        sock.send_multipart([b"a", b"b"])
        assert msgpack.unpackb(sock.recv())["code"] == ErrorCode.MALFORMED_FRAME
        sock.send(msgpack.packb(ConnectRequest("c", "x", [], [pair.sid], 6).to_wire()))
        rep = ConnectReply.from_wire(msgpack.unpackb(sock.recv(), raw=False))
        assert rep.code == ErrorCode.OK and rep.id == 6
        assert rep.segments == [SegmentMr(pair.sid, pair.seg.address,
                                          pair.desc.extra["rdma"]["rkey"], pair.seg.size)]
    finally:
        sock.close(linger=0)


def test_reconnect_with_the_same_id_replaces_responder_qps(pair: Pair) -> None:
    info = QpInfo(0x42, 1, 1, GID, 4096)
    req = ConnectRequest("same", "host-z", [info, info], [], 1).to_wire()
    first = pair.rb.handle_connect(req)
    second = pair.rb.handle_connect(req)
    assert first["code"] == second["code"] == ErrorCode.OK
    assert len(second["qps"]) == 2 and second["qps"] != first["qps"]
    assert pair.rb.stats()["accepted_connections"] == 1
    # the replaced QPs are destroyed (gone from the fabric)
    assert all(q[0] not in pair.fabric.qps for q in first["qps"])


def test_descriptor_extra_roundtrips_through_the_wire(pair: Pair) -> None:
    d = SegmentDescriptor.from_wire(msgpack.unpackb(msgpack.packb(pair.desc.to_wire()),
                                                    raw=False))
    mr = SegmentMr.from_extra(d.segment_id, d.extra["rdma"])
    assert mr.addr == pair.seg.address and mr.length == pair.seg.size
    assert d.extra["rdma"]["connect"].startswith("tcp://127.0.0.1:")


def test_owner_enforcing_capabilities_hands_out_no_rkeys(pair: Pair) -> None:
    """RDMA is one-sided: an owner whose transfer server checks capabilities
    refuses rdma connects, so requests go to tcp where each one is checked."""
    calls: list[int] = []

    def verifier(seg: Any, op: Any, off: int, n: int, cap: bytes) -> ErrorCode | None:
        calls.append(n)
        return None if cap == b"ok" else ErrorCode.PERMISSION_DENIED

    server = pair.b.server
    assert server is not None
    server.verify_capability = verifier
    assert pair.rb.describe_segment(pair.seg) == {}
    buf = np.full(4 * KiB, 1, dtype=np.uint8)
    [st] = pair.a.transfer([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, buf.nbytes,
                                            capability=b"ok")], timeout=10)
    assert st.ok and st.transport == "tcp" and "PERMISSION_DENIED" in st.errors[0]
    assert calls == [4 * KiB]


class HostMemoryCudaDouble:
    """A fake of the CUDA runtime for the GPU this machine lacks: 'device'
    buffers are host memory and cudaMemcpy is a memmove; it records copies and
    host registrations so the staging path can be checked."""

    backend = "host-memory double"

    def __init__(self) -> None:
        self.copies: list[int] = []
        self.host_registered: list[tuple[int, int]] = []

    def memcpy(self, dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src, n)
        self.copies.append(n)

    def host_register(self, ptr: int, n: int) -> None:
        self.host_registered.append((ptr, n))


@pytest.mark.parametrize("peer_memory", [False, True])
def test_gpu_buffers_direct_with_peer_memory_else_staged(peer_memory: bool) -> None:
    """A registered GPU buffer is RDMA'd directly where the NIC can register
    device memory (peer-memory client), else staged through the registered
    host buffers with cudaMemcpy."""
    fake = HostMemoryCudaDouble()
    p = Pair(cuda=lambda: (fake, ""))
    try:
        n = 100 * KiB
        src = np.frombuffer(np.random.default_rng(6).bytes(n), dtype=np.uint8).copy()
        dst = np.zeros(n, dtype=np.uint8)
        if not peer_memory:
            p.fabric.unregistrable += [(int(src.ctypes.data), n), (int(dst.ctypes.data), n)]
        hs = p.a.register_buffer(int(src.ctypes.data), length=n, device="cuda")
        hd = p.a.register_buffer(int(dst.ctypes.data), length=n, device="cuda")
        assert hs.is_gpu and hd.is_gpu
        sts = p.a.transfer([TransferRequest(TransferOp.WRITE, hs, p.sid, 4 * KiB, n)],
                           timeout=10)
        sts += p.a.transfer([TransferRequest(TransferOp.READ, hd, p.sid, 4 * KiB, n)],
                            timeout=10)
        assert [(s.ok, s.transport) for s in sts] == [(True, "rdma")] * 2
        assert np.array_equal(p.seg.array()[4 * KiB:4 * KiB + n], src)
        assert np.array_equal(dst, src)
        st = p.ra.stats()
        if peer_memory:
            assert fake.copies == [] and st["registered_buffers"] == 2
        else:
            # 100 KiB in 32 KiB staging buffers: 4 copies each way
            assert sum(fake.copies) == 2 * n and len(fake.copies) == 8
            assert st["registered_buffers"] == 0 and st["staged_bytes"] == 2 * n
            assert len(fake.host_registered) == 1  # the staging pool, page-locked once
    finally:
        p.close()


def test_closing_the_engine_during_a_stalled_transfer_returns_promptly(pair: Pair) -> None:
    import threading
    import time

    pair.fabric.stall = True
    buf = np.full(8 * KiB, 2, dtype=np.uint8)
    h = pair.a.submit([TransferRequest(TransferOp.WRITE, buf, pair.sid, 0, buf.nbytes,
                                       transport="rdma")])
    time.sleep(0.2)  # the worker is polling a CQ that never completes
    t0 = time.monotonic()
    closer = threading.Thread(target=pair.a.close)
    closer.start()
    closer.join(5)
    assert not closer.is_alive() and time.monotonic() - t0 < 3
    assert h.wait(5)
    [st] = h.status()
    assert st.state is RequestState.FAILED and st.code == ErrorCode.CLOSED


def test_sge_gathering_is_bounded_by_the_device_limit() -> None:
    p = Pair(_settings(max_sge=16))  # the double's devices allow 8 SGEs per WR
    try:
        src = np.frombuffer(np.random.default_rng(7).bytes(24 * KiB), dtype=np.uint8).copy()
        h = p.a.register_buffer(src)
        reqs = [TransferRequest(TransferOp.WRITE, h, p.sid, i * KiB, KiB,
                                buffer_offset=i * 2 * KiB) for i in range(12)]
        assert all(s.ok and s.transport == "rdma" for s in p.a.transfer(reqs, timeout=10))
        assert p.fabric.sge_counts == [8, 4]
        expect = np.concatenate([src[i * 2 * KiB:i * 2 * KiB + KiB] for i in range(12)])
        assert np.array_equal(p.seg.array()[:12 * KiB], expect)
    finally:
        p.close()
