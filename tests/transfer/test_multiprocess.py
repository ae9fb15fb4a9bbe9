"""Transfers between real processes: a peer child owns a /dev/shm segment and
runs its transfer server (tests/support/peer.py)."""

from __future__ import annotations

import os
import signal
import time
import zlib
from typing import Any

import msgspec
import numpy as np
import pytest

from kvpool.core.errors import ErrorCode
from kvpool.transfer import RequestState, TransferOp, TransferRequest
from support.peer import fill_pattern, freeze

R, W = TransferOp.READ, TransferOp.WRITE
MiB = 1 << 20


@pytest.mark.parametrize("size", [1, 4097, 3 * MiB + 5])
def test_same_host_peer_uses_shm(make_engine: Any, make_peer: Any, size: int) -> None:
    peer = make_peer(8 * MiB, host_id="host-test")
    peer.cmd("fill 7")
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    off = 12345
    expect = fill_pattern(7, 8 * MiB)[off:off + size]
    dst = np.zeros(size + 3, np.uint8)
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, off, size, buffer_offset=3)], 10)
    assert st[0].ok and st[0].transport == "shm", st
    assert zlib.crc32(dst[3:]) == zlib.crc32(expect)
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    st = e.transfer([TransferRequest(W, src, peer.segment_id, 777, size)], 10)
    assert st[0].ok and st[0].transport == "shm"
    assert peer.crc(777, size) == zlib.crc32(src)
    shm = e.transport("shm")
    assert shm is not None and shm.stats()["mapped_segments"] == 1
    e.remove_peer_segment(peer.segment_id)
    assert shm.stats()["mapped_segments"] == 0


@pytest.mark.parametrize("size", [1, 65537, 64 * MiB])
def test_remote_peer_uses_tcp(make_engine: Any, make_peer: Any, size: int) -> None:
    seg_size = max(MiB, size + 8192)
    peer = make_peer(seg_size, host_id="other-host")
    peer.cmd("fill 3")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 30}}})
    e.add_peer_segment(peer.desc)
    off = 4093
    dst = np.zeros(size, np.uint8)
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, off, size)], 60)
    assert st[0].ok and st[0].transport == "tcp", st
    assert zlib.crc32(dst) == zlib.crc32(fill_pattern(3, seg_size)[off:off + size])
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    st = e.transfer([TransferRequest(W, memoryview(src), peer.segment_id, 1, size)], 60)
    assert st[0].ok and st[0].transport == "tcp"
    assert peer.crc(1, size) == zlib.crc32(src)


def test_batch_of_32_both_transports(make_engine: Any, make_peer: Any) -> None:
    local = make_peer(4 * MiB, host_id="host-test")
    remote = make_peer(4 * MiB, host_id="far-away")
    e = make_engine("host-test")
    e.add_peer_segment(local.desc)
    e.add_peer_segment(remote.desc)
    src = np.random.default_rng(0).integers(0, 256, 32 * 65536, dtype=np.uint8)
    reqs = [TransferRequest(W, src, (local if i % 2 else remote).segment_id, i * 65536, 65536,
                            buffer_offset=i * 65536) for i in range(32)]
    h = e.submit(reqs)
    assert h.wait(20) and h.ok
    assert [s.transport for s in h.status()] == ["tcp", "shm"] * 16
    assert sorted(sb.transport for sb in h.sub_batches) == ["shm", "tcp"]
    for i in range(32):
        p = local if i % 2 else remote
        assert p.crc(i * 65536, 65536) == zlib.crc32(src[i * 65536:(i + 1) * 65536])


def test_server_stopped_fails_over_tcp_to_shm(make_engine: Any, make_peer: Any) -> None:
    peer = make_peer(4 * MiB, host_id="host-test")
    peer.cmd("fill 11")
    e = make_engine("host-test", overrides={
        "rules": [{"name": "tcp-first", "kind": "memory", "transports": ["tcp", "shm"]}],
        "transports": {"tcp": {"timeout_s": 1.0, "retries": 0}}})
    e.add_peer_segment(peer.desc)
    dst = np.zeros(4 * MiB, np.uint8)
    # warm up: tcp serves while the server is up
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, 0, 4096)], 10)
    assert st[0].transport == "tcp" and st[0].ok
    peer.cmd("stop-server")
    t0 = time.monotonic()
    reqs = [TransferRequest(R, dst, peer.segment_id, i * MiB, MiB, buffer_offset=i * MiB)
            for i in range(4)]
    h = e.submit(reqs)
    assert h.wait(10)
    assert time.monotonic() - t0 < 5
    st = h.status()
    assert all(s.ok and s.transport == "shm" for s in st), st
    assert all(s.errors and s.errors[0].startswith("tcp:") for s in st)
    assert (dst == fill_pattern(11, 4 * MiB)).all()


def test_peer_killed_mid_transfer_errors_within_timeout(make_engine: Any,
                                                        make_peer: Any) -> None:
    peer = make_peer(64 * MiB, host_id="far-away")
    timeout = 10.0
    e = make_engine("host-test", overrides={
        "transports": {"tcp": {"timeout_s": timeout, "retries": 0, "chunk_size": "256KiB",
                               "window": 2, "options": {"bulk": False}}}})  # ZeroMQ path
    e.add_peer_segment(peer.desc)
    dst = np.zeros(64 * MiB, np.uint8)
    reqs = [TransferRequest(R, dst, peer.segment_id, i * 4 * MiB, 4 * MiB,
                            buffer_offset=i * 4 * MiB) for i in range(16)]
    # freeze the peer first so the batch cannot finish before the kill lands
    # (on an idle box 64 MiB can cross loopback within the 50 ms below)
    freeze(peer.proc.pid)
    t0 = time.monotonic()
    h = e.submit(reqs)
    time.sleep(0.05)
    peer.kill()
    finished = h.wait(timeout + 3.0)
    elapsed = time.monotonic() - t0
    assert finished, "batch hung after the peer was killed"
    # the disconnect is seen by the socket monitor: no need to wait for the deadline
    assert elapsed < 3.0, elapsed
    st = h.status()
    failed = [s for s in st if s.state is RequestState.FAILED]
    assert len(failed) == len(st), "requests finished although the peer was frozen, then killed"
    for s in failed:
        assert s.code in (ErrorCode.TRANSFER_FAIL, ErrorCode.TIMEOUT), s
        assert "disconnected" in s.errors[-1] or "cannot connect" in s.errors[-1], s
        assert s.transport == "tcp" and s.errors
    assert all(s.state.terminal for s in st)


def test_dead_peer_does_not_hold_up_live_peer(make_engine: Any, make_peer: Any) -> None:
    dead = make_peer(MiB, host_id="far-1")
    live = make_peer(MiB, host_id="far-2")
    live.cmd("fill 5")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 2.0,
                                                                   "retries": 0}}})
    e.add_peer_segment(dead.desc)
    e.add_peer_segment(live.desc)
    dead.kill()
    a, b = np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)
    t0 = time.monotonic()
    h = e.submit([TransferRequest(R, a, dead.segment_id, 0, MiB),
                  TransferRequest(R, b, live.segment_id, 0, MiB)])
    while h.status()[1].state is not RequestState.DONE and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    live_done = time.monotonic() - t0
    assert h.status()[1].ok and live_done < 1.0
    assert (b == fill_pattern(5, MiB)).all()
    assert h.wait(5)
    st = h.status()
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.TRANSFER_FAIL
    assert "cannot connect" in st[0].errors[-1]
    assert time.monotonic() - t0 < 1.5  # refused connection, not the 2 s deadline


def test_server_refuses_unowned_and_out_of_bounds(make_engine: Any, make_peer: Any) -> None:
    peer = make_peer(MiB, host_id="far-away")
    e = make_engine("host-test")
    # a descriptor that names the peer's server but a segment it does not own
    fake = msgspec.structs.replace(peer.desc, segment_id="not-" + peer.segment_id)
    # a descriptor that lies about the size: the server checks the real one
    big = msgspec.structs.replace(peer.desc, segment_id=peer.segment_id, size=4 * MiB)
    e.add_peer_segment(fake)
    e.add_peer_segment(big)
    buf = np.zeros(MiB, np.uint8)
    t0 = time.monotonic()
    st = e.transfer([TransferRequest(R, buf, fake.segment_id, 0, 100),
                     TransferRequest(W, buf, big.segment_id, 2 * MiB, 100),
                     TransferRequest(R, buf, big.segment_id, MiB - 100, 100)], 10)
    assert time.monotonic() - t0 < 2  # refusals are final: no retries, no failover wait
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.SEGMENT_NOT_FOUND
    assert st[1].state is RequestState.FAILED and st[1].code == ErrorCode.OUT_OF_BOUNDS
    assert st[2].ok
    assert len(st[0].errors) == 1 and len(st[1].errors) == 1


def test_frozen_peer_times_out_at_deadline(make_engine: Any, make_peer: Any) -> None:

    peer = make_peer(MiB, host_id="far-away")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 1.0,
                                                                   "retries": 0}}})
    e.add_peer_segment(peer.desc)
    buf = np.zeros(MiB, np.uint8)
    assert e.transfer([TransferRequest(R, buf, peer.segment_id, 0, 4096)], 5)[0].ok
    freeze(peer.proc.pid)  # connected but silent: only the deadline helps
    try:
        t0 = time.monotonic()
        h = e.submit([TransferRequest(R, buf, peer.segment_id, 0, MiB)])
        assert h.wait(5), "hung on a silent peer"
        assert 0.9 < time.monotonic() - t0 < 3.0, h.status()
        st = h.status()[0]
        assert st.state is RequestState.FAILED and st.code == ErrorCode.TIMEOUT
        assert "deadline" in st.errors[-1]
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    # the peer answers again: a fresh connection serves it (no stale replies mix in)
    st2 = e.transfer([TransferRequest(R, buf, peer.segment_id, 0, 4096)], 5)
    assert st2[0].ok, st2


def test_server_stopped_mid_batch_fails_over_and_completes(make_engine: Any,
                                                           make_peer: Any) -> None:
    size = 64 * MiB
    peer = make_peer(size, host_id="host-test")
    peer.cmd("fill 13")
    e = make_engine("host-test", overrides={
        "rules": [{"name": "tcp-first", "kind": "memory", "transports": ["tcp", "shm"]}],
        # ZeroMQ (the peer's bulk socket off), small chunks, one in flight: the
        # batch takes long enough to be cut mid-way
        "transports": {"tcp": {"timeout_s": 10.0, "retries": 0, "chunk_size": "64KiB",
                               "window": 1, "threads": 1, "options": {"bulk": False}}}})
    e.add_peer_segment(peer.desc)
    dst = np.zeros(size, np.uint8)
    n = 64
    step = size // n
    h = e.submit([TransferRequest(R, dst, peer.segment_id, i * step, step,
                                  buffer_offset=i * step) for i in range(n)])
    deadline = time.monotonic() + 10
    while sum(s.ok for s in h.status()) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    peer.cmd("stop-server")
    assert h.wait(10), "batch hung after the server stopped"
    assert time.monotonic() - t0 < 5  # disconnect noticed, not the 10 s deadline
    st = h.status()
    assert all(s.ok for s in st), [s for s in st if not s.ok][:2]
    via = [s.transport for s in st]
    assert "tcp" in via and "shm" in via, via
    moved = [s for s in st if s.transport == "shm"]
    assert all(s.errors and s.errors[0].startswith("tcp:") for s in moved)
    assert zlib.crc32(dst) == zlib.crc32(fill_pattern(13, size))


def test_dead_peer_pauses_tcp_only_towards_that_peer(make_engine: Any, make_peer: Any) -> None:
    dead = make_peer(MiB, host_id="far-1")
    live = make_peer(MiB, host_id="far-2")
    e = make_engine("host-test", overrides={"transports": {"tcp": {
        "timeout_s": 2.0, "retries": 0, "pause_after_failures": 2, "cooldown_s": 30}}})
    e.add_peer_segment(dead.desc)
    e.add_peer_segment(live.desc)
    dead.kill()
    buf = np.zeros(4096, np.uint8)
    for _ in range(2):
        st = e.transfer([TransferRequest(R, buf, dead.segment_id, 0, 4096)], 5)
        assert st[0].state is RequestState.FAILED and st[0].transport == "tcp"
    t0 = time.monotonic()
    st = e.transfer([TransferRequest(R, buf, dead.segment_id, 0, 4096)], 5)
    assert st[0].state is RequestState.FAILED and "paused" in st[0].errors[-1]
    assert time.monotonic() - t0 < 0.5  # refused at planning, no network attempt
    # the live peer is still served by tcp
    st = e.transfer([TransferRequest(R, buf, live.segment_id, 0, 4096)], 5)
    assert st[0].ok and st[0].transport == "tcp"
