"""The tcp transport's bulk path (kvpool.transfer.bulk) against real peer processes."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
import zlib
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvpool.core.capability import CapabilitySigner, CapOp, DenyReason
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import decode_frame, encode_frame
from kvpool.transfer import RequestState, TransferOp, TransferRequest, wire
from kvpool.transfer.server import OP_BULK
from support.bulk import exchange as raw_exchange
from support.bulk import frame, split_reply
from support.peer import fill_pattern, freeze
from support.proc_cpu import cpu_seconds
from support.wait import wait_until

MiB = 1 << 20
R, W = TransferOp.READ, TransferOp.WRITE


def _bulk_ready(e: Any, peer: Any) -> Any:
    """Make the engine learn the peer's bulk port (asked in the background)."""
    tcp = e.transport("tcp")
    buf = np.zeros(MiB, np.uint8)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        before = tcp.stats()["bulk_requests"]
        assert e.transfer([TransferRequest(R, buf, peer.segment_id, 0, MiB)], 10)[0].ok
        if tcp.stats()["bulk_requests"] > before:
            return tcp
        time.sleep(0.02)
    raise AssertionError("the bulk path was never used")


def _bulk_port_known(e: Any, endpoint: str) -> None:
    """Wait (5 s at most) until the engine learned the bulk port of ``endpoint``
    (asked in the background)."""
    wait_until(lambda: e.transport("tcp").bulk_peers.peer(endpoint).port, 5,
               "the peer's bulk port", interval_s=0.02)


def test_bulk_data_checksums_and_refusals(make_engine: Any, make_peer: Any) -> None:
    seg = 40 * MiB
    peer = make_peer(seg, host_id="far-away")
    peer.cmd("fill 9")
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    tcp = _bulk_ready(e, peer)
    n0 = tcp.stats()["bulk_requests"]
    pattern = fill_pattern(9, seg)
    cases = [(64 * 1024, 1), (MiB + 7, 4093), (16 * MiB, 12345), (33 * MiB, 3)]
    for size, off in cases:  # reads first: the writes below change the pattern
        dst = np.zeros(size + 5, np.uint8)
        st = e.transfer([TransferRequest(R, dst, peer.segment_id, off, size, buffer_offset=5)],
                        30)
        assert st[0].ok and st[0].transport == "tcp", st
        assert zlib.crc32(dst[5:]) == zlib.crc32(pattern[off:off + size])
    for size, off in cases:
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        st = e.transfer([TransferRequest(W, memoryview(src), peer.segment_id, off + 1, size)], 30)
        assert st[0].ok
        assert peer.crc(off + 1, size) == zlib.crc32(src)
    assert tcp.stats()["bulk_requests"] >= n0 + 8
    # refusals keep their codes and the connection stays in step
    big = np.zeros(2 * MiB, np.uint8)
    st = e.transfer([TransferRequest(W, big, peer.segment_id, seg - MiB, 2 * MiB),
                     TransferRequest(R, big, peer.segment_id, seg - MiB, 2 * MiB),
                     TransferRequest(W, big, peer.segment_id, 0, 2 * MiB)], 10)
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.OUT_OF_BOUNDS
    assert st[1].state is RequestState.FAILED and st[1].code == ErrorCode.OUT_OF_BOUNDS
    assert st[2].ok
    assert peer.crc(0, 2 * MiB) == zlib.crc32(big)


def test_bulk_batch_to_two_peers_and_off_switch(make_engine: Any, make_peer: Any) -> None:
    a, b = make_peer(8 * MiB, host_id="far-1"), make_peer(8 * MiB, host_id="far-2")
    e = make_engine("host-test")
    e.add_peer_segment(a.desc)
    e.add_peer_segment(b.desc)
    _bulk_ready(e, a)
    tcp = _bulk_ready(e, b)
    src = np.random.default_rng(1).integers(0, 256, 8 * MiB, dtype=np.uint8)
    reqs = [TransferRequest(W, src, p.segment_id, i * MiB, MiB, buffer_offset=i * MiB)
            for p in (a, b) for i in range(8)]
    n0 = tcp.stats()["bulk_requests"]
    st = e.transfer(reqs, 30)
    assert all(s.ok for s in st), st
    assert tcp.stats()["bulk_requests"] == n0 + 16
    assert a.crc(0, 8 * MiB) == zlib.crc32(src) == b.crc(0, 8 * MiB)
    off = make_engine("host-test", overrides={"transports": {"tcp": {"options": {"bulk": False}}}})
    off.add_peer_segment(a.desc)
    dst = np.zeros(8 * MiB, np.uint8)
    for _ in range(3):
        assert off.transfer([TransferRequest(R, dst, a.segment_id, 0, 8 * MiB)], 30)[0].ok
    assert off.transport("tcp").stats()["bulk_requests"] == 0
    assert zlib.crc32(dst) == zlib.crc32(src)


def test_bulk_peer_killed_mid_transfer(make_engine: Any, make_peer: Any) -> None:
    peer = make_peer(256 * MiB, host_id="far-away")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 10.0,
                                                                   "retries": 0}}})
    e.add_peer_segment(peer.desc)
    _bulk_ready(e, peer)
    dst = np.zeros(256 * MiB, np.uint8)
    reqs = [TransferRequest(R, dst, peer.segment_id, i * 16 * MiB, 16 * MiB,
                            buffer_offset=i * 16 * MiB) for i in range(16)]
    t0 = time.monotonic()
    h = e.submit(reqs)
    time.sleep(0.01)
    peer.kill()
    assert h.wait(8.0), "batch hung after the peer was killed"
    assert time.monotonic() - t0 < 5.0  # EOF/reset, not the 10 s deadline
    st = h.status()
    failed = [s for s in st if s.state is RequestState.FAILED]
    assert failed, "every request finished although the peer was killed 10 ms in"
    for s in failed:
        assert s.code in (ErrorCode.TRANSFER_FAIL, ErrorCode.TIMEOUT), s
        assert s.errors and s.transport == "tcp"


def test_bulk_socket_garbage_and_op_query(make_peer: Any) -> None:
    peer = make_peer(MiB, host_id="far-away")
    peer.cmd("fill 5")
    pattern = fill_pattern(5, MiB)
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(peer.desc.endpoint)
        s.send(encode_frame({"op": OP_BULK, "id": 3}))
        assert s.poll(5000)
        rep = decode_frame(s.recv_multipart()[-1])
        s.close()
    finally:
        ctx.term()
    assert rep["code"] == 0 and rep["id"] == 3 and rep["bulk"] > 0 and rep["max"] >= MiB
    assert rep["hdr"] >= 256
    host = peer.desc.endpoint.split("://")[1].rsplit(":", 1)[0]
    seg = peer.segment_id

    def exchange(data: bytes) -> bytes:
        return raw_exchange(host, rep["bulk"], data)

    # garbage, a huge header length, a map instead of the array header: closed, never served
    assert exchange(b"\xff\xff\xff\xff" + b"x" * 64) == b""
    assert exchange(b"\x05\x00\x00\x00\xc1\xc1\xc1\xc1\xc1") == b""
    old = encode_frame({"op": 1, "id": 2, "seg": seg, "off": 0, "len": 4, "cap": b""})
    assert exchange(len(old).to_bytes(4, "little") + old) == b""
    # an unknown op: every range refused with UNKNOWN_OP, and the stream goes on
    r, rest = split_reply(exchange(frame(wire.BulkRequest(1, 3, [wire.BulkItem(seg, 0, 4)]))))
    assert r.id == 1 and r.codes == [ErrorCode.UNKNOWN_OP] and rest == b""
    # a READ of three ranges, the middle one refused: only the accepted payloads follow
    r, rest = split_reply(exchange(frame(wire.BulkRequest(7, int(R), [
        wire.BulkItem(seg, 10, 5), wire.BulkItem("nope", 0, 4), wire.BulkItem(seg, MiB - 3, 3)]))))
    assert r.id == 7 and r.codes == [0, ErrorCode.SEGMENT_NOT_FOUND, 0] and "nope" in r.err
    assert rest == pattern[10:15].tobytes() + pattern[MiB - 3:].tobytes()
    # a WRITE with a refused range in the middle: its payload is dropped, the others land,
    # and the next request on the stream is served
    out = exchange(frame(wire.BulkRequest(8, int(W), [
        wire.BulkItem(seg, 0, 4), wire.BulkItem(seg, MiB - 2, 4), wire.BulkItem(seg, 100, 3)]))
        + b"AAAA" + b"BBBB" + b"CCC"
        + frame(wire.BulkRequest(9, int(R), [wire.BulkItem(seg, 0, 4)])))
    r, rest = split_reply(out)
    assert r.id == 8 and r.codes == [0, ErrorCode.OUT_OF_BOUNDS, 0]
    r2, rest = split_reply(rest)
    assert r2.id == 9 and r2.codes == [0] and rest == b"AAAA"
    assert peer.crc(100, 3) == zlib.crc32(b"CCC")
    assert peer.crc(MiB - 8, 8) == zlib.crc32(pattern[MiB - 8:].tobytes())
    # a refused WRITE range whose length cannot be trusted: answered, then closed
    out = exchange(frame(wire.BulkRequest(10, int(W), [wire.BulkItem("nope", 0, 1 << 62)]))
                   + frame(wire.BulkRequest(11, int(R), [wire.BulkItem(seg, 0, 4)])))
    r, rest = split_reply(out)
    assert r.id == 10 and r.codes == [ErrorCode.SEGMENT_NOT_FOUND] and rest == b""
    # lone ranges (the server's one-range path): an empty WRITE and READ, a WRITE,
    # then a READ of it on the same stream: replies in order, payloads in step
    out = exchange(frame(wire.BulkRequest(12, int(W), [wire.BulkItem(seg, 200, 0)]))
                   + frame(wire.BulkRequest(13, int(R), [wire.BulkItem(seg, 200, 0)]))
                   + frame(wire.BulkRequest(14, int(W), [wire.BulkItem(seg, 200, 6)]))
                   + b"lone-w"
                   + frame(wire.BulkRequest(15, int(R), [wire.BulkItem(seg, 199, 8)])))
    got = []
    while out:
        r, out = split_reply(out)
        got.append((r.id, r.codes))
        if r.id == 15:
            assert out == pattern[199:200].tobytes() + b"lone-w" + pattern[206:207].tobytes()
            out = b""
    assert got == [(12, [0]), (13, [0]), (14, [0]), (15, [0])]
    # the peer still serves over ZeroMQ
    assert peer.crc(0, 16) >= 0


def test_lone_large_request_goes_over_parallel_stripes(make_engine: Any, make_peer: Any) -> None:
    """A single request of >= 8 MiB is cut into page-aligned stripes, one per tcp
    thread, each over its own bulk connection; it is reported once, bytes intact."""
    seg = 48 * MiB
    peer = make_peer(seg, host_id="far-away")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"threads": 2}}})
    e.add_peer_segment(peer.desc)
    tcp = _bulk_ready(e, peer)
    n = 20 * MiB + 12345  # not a multiple of the stripe
    src = np.random.default_rng(7).integers(0, 256, n + 3, dtype=np.uint8)
    n0 = tcp.stats()["bulk_requests"]
    st = e.transfer([TransferRequest(W, src, peer.segment_id, 4096 + 1, n, buffer_offset=3)],
                    30)
    assert st[0].ok and st[0].transport == "tcp", st
    assert tcp.stats()["bulk_requests"] == n0 + 2  # two stripes
    assert peer.crc(4096 + 1, n) == zlib.crc32(src[3:])
    dst = np.zeros(n + 5, np.uint8)
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, 4096 + 1, n, buffer_offset=5)],
                    30)
    assert st[0].ok, st
    assert zlib.crc32(dst[5:]) == zlib.crc32(src[3:])
    assert tcp.stats()["bulk_requests"] == n0 + 4


def test_polling_bulk_server_serves_and_stops_polling_when_idle(make_engine: Any,
                                                                make_peer: Any) -> None:
    """A holder whose bulk connections poll for the next request
    (``server.bulk_spin_us``) serves requests back to back and after pauses
    longer than its window, every byte intact, and does not keep polling an
    idle connection: its CPU stays near nothing while the client is silent."""
    peer = make_peer(4 * MiB, host_id="far-away", bulk_spin_us=20_000)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    _bulk_ready(e, peer)
    rng = np.random.default_rng(11)
    for i in range(40):
        if i % 10 == 9:
            time.sleep(0.05)  # a pause beyond the window: the poll ends, a blocking read serves
        src = rng.integers(0, 256, 4096, dtype=np.uint8)
        st = e.transfer([TransferRequest(W, src, peer.segment_id, i * 4096, 4096)], 10)
        assert st[0].ok, st
        dst = np.zeros(4096, np.uint8)
        st = e.transfer([TransferRequest(R, dst, peer.segment_id, i * 4096, 4096)], 10)
        assert st[0].ok and np.array_equal(dst, src), st
    pid = peer.proc.pid
    cpu0 = cpu_seconds(pid)
    time.sleep(0.5)  # silent: a poll of at most 20 ms, then the thread sleeps
    assert cpu_seconds(pid) - cpu0 < 0.15


def test_first_request_takes_the_published_bulk_port(make_engine: Any,
                                                     make_segment: Any) -> None:
    """A memory segment's descriptor publishes its owner's bulk port: a peer's
    very first request goes over the bulk socket (no ZeroMQ, no BULK query).
    A stale port (the owner restarted) or a hint that does not parse costs
    nothing but the fast path: the request is served over ZeroMQ, intact."""
    srv = make_engine("host-srv")
    seg = make_segment(4 * MiB)
    desc = srv.add_local_segment(seg)
    assert srv.server is not None and srv.server.bulk is not None
    assert desc.extra["bulk"]["bulk"] == srv.server.bulk.port
    assert wire.bulk_hint(desc.extra) == srv.server.bulk_offer()
    src = np.random.default_rng(5).integers(0, 256, MiB, dtype=np.uint8)
    cases = (("published", desc.extra),
             ("stale port", {"bulk": {**desc.extra["bulk"], "bulk": _closed_port()}}),
             ("unparseable", {"bulk": {"bulk": "x"}}))
    for k, (what, extra) in enumerate(cases):
        cli = make_engine(f"host-cli-{k}")
        tcp = cli.transport("tcp")
        asked: list[str] = []
        query = tcp.bulk_peers.query
        tcp.bulk_peers.query = lambda ep, t, q=query, a=asked: (a.append(ep), q(ep, t))[1]
        cli.add_peer_segment(msgspec.structs.replace(desc, extra=extra))
        off = k * MiB
        for n in (4096, MiB):  # the lone-request path, then the routed one
            st = cli.transfer([TransferRequest(W, src, desc.segment_id, off, n)], 10)
            assert st[0].ok, (what, st)
            assert seg.array()[off:off + n].tobytes() == src[:n].tobytes(), what
            dst = np.zeros(n, np.uint8)
            assert cli.transfer([TransferRequest(R, dst, desc.segment_id, off, n)], 10)[0].ok
            assert dst.tobytes() == src[:n].tobytes(), what
        bulk = tcp.stats()["bulk_requests"]
        if what == "published":
            assert bulk == 4 and asked == [], (what, bulk, asked)
        else:  # served over ZeroMQ, the peer asked (in the background)
            assert bulk < 4 and tcp.stats()["bytes_sent"] > 0, (what, bulk)
            wait_until(lambda a=asked: a == [desc.endpoint], 5, "the BULK query")


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_lone_small_request_takes_one_idle_connection(make_engine: Any,
                                                      make_segment: Any) -> None:
    """A lone request to a peer whose bulk port is known goes straight over one
    idle bulk connection: bytes intact at any offset, a refusal keeps its code
    (final: tried once) and the connection stays in step; before the port is
    known the request goes over ZeroMQ, and after the peer closed it fails
    (TRANSFER_FAIL), soon."""
    srv = make_engine("host-srv")
    seg = make_segment(4 * MiB)
    desc = srv.add_local_segment(seg)

    def verify(sg: Any, op: TransferOp, off: int, n: int, cap: bytes) -> ErrorCode | None:
        return None if off < 3 * MiB else ErrorCode.PERMISSION_DENIED

    assert srv.server is not None and srv.server.bulk is not None
    srv.server.verify_capability = verify
    cli = make_engine("host-cli", overrides={"transports": {"tcp": {"retries": 1}}})
    # a peer that publishes no bulk port in its descriptor (an older one)
    cli.add_peer_segment(msgspec.structs.replace(desc, extra={}))
    tcp = cli.transport("tcp")
    src = np.random.default_rng(21).integers(0, 256, 2 * MiB, dtype=np.uint8)
    st = cli.transfer([TransferRequest(W, src, desc.segment_id, 0, 4096)], 10)
    assert st[0].ok and tcp.stats()["bulk_requests"] == 0  # port not known yet: ZeroMQ
    _bulk_port_known(cli, desc.endpoint)
    routed: list[int] = []  # sub-batch routing: the lone requests below skip it
    route = tcp._route

    def spy(items: Any, report: Any) -> Any:
        routed.append(len(items))
        return route(items, report)

    tcp._route = spy
    for n, off, boff in ((1, 7, 3), (4096, 4096, 0), (MiB + 3, 2 * 4096 + 1, 5)):
        n0 = tcp.stats()["bulk_requests"]
        st = cli.transfer([TransferRequest(W, src, desc.segment_id, off, n, buffer_offset=boff)],
                          10)
        assert st[0].ok and st[0].errors == [], st
        assert seg.array()[off:off + n].tobytes() == src[boff:boff + n].tobytes()
        dst = np.zeros(n + 9, np.uint8)
        st = cli.run([TransferRequest(R, dst, desc.segment_id, off, n, buffer_offset=9)], 10)
        assert st[0].ok, st
        assert dst[9:].tobytes() == src[boff:boff + n].tobytes()
        assert tcp.stats()["bulk_requests"] == n0 + 2
    assert len(tcp.bulk_peers.clients) == 1 and routed == []  # one connection, straight
    # a batch of small requests to the one segment goes the same way, as one
    # bulk request: every range's bytes and code (one refused range: its own
    # code, not retried; the others DONE once)
    for buf in (src, cli.register_buffer(src)):  # the general engine path, the batch path
        n0 = tcp.stats()["bulk_requests"]
        offs = [MiB + i * 8192 + 5 for i in range(16)]  # clear of the ranges above
        bo = {o: 2 * (o - MiB) + 3 for o in offs}
        reqs = [TransferRequest(W, buf, desc.segment_id, o, 4096, buffer_offset=bo[o])
                for o in offs]
        st = cli.transfer(reqs, 10)
        assert all(x.ok and x.errors == [] for x in st), st
        assert all(seg.array()[o:o + 4096].tobytes() == src[bo[o]:bo[o] + 4096].tobytes()
                   for o in offs)
        dst = np.zeros(16 * 4096, np.uint8)
        st = cli.run([TransferRequest(R, dst, desc.segment_id, o, 4096, buffer_offset=k * 4096)
                      for k, o in enumerate(offs)], 10)
        assert all(x.ok for x in st) and dst.tobytes() == b"".join(
            src[bo[o]:bo[o] + 4096].tobytes() for o in offs)
        reqs[3] = TransferRequest(W, buf, desc.segment_id, 3 * MiB + 64, 4096)
        st = cli.transfer(reqs, 10)
        assert [x.ok for x in st] == [k != 3 for k in range(16)], st
        assert st[3].code == ErrorCode.PERMISSION_DENIED and len(st[3].errors) == 1
        assert tcp.stats()["bulk_requests"] == n0 + 48
    assert len(tcp.bulk_peers.clients) == 1 and routed == []
    n0 = tcp.stats()["bulk_requests"]
    st = cli.transfer([TransferRequest(W, src, desc.segment_id, 3 * MiB, 4096)], 10)
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.PERMISSION_DENIED
    assert len(st[0].errors) == 1 and tcp.stats()["bulk_requests"] == n0 + 1, st
    dst = np.zeros(4096, np.uint8)
    assert cli.run([TransferRequest(R, dst, desc.segment_id, 4096, 4096)], 10)[0].ok
    assert dst.tobytes() == src[:4096].tobytes()
    # the peer goes away: a retryable failure, tried again (retries: 1), then FAILED
    srv.close()
    t0 = time.monotonic()
    st = cli.transfer([TransferRequest(W, src, desc.segment_id, 0, 4096)], 10)
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.TRANSFER_FAIL, st
    assert len(st[0].errors) == 2 and st[0].transport == "tcp", st
    assert time.monotonic() - t0 < 5.0


def test_lone_large_request_stripes_keep_codes_and_bytes(make_engine: Any,
                                                        make_segment: Any) -> None:
    """Every stripe of a lone large request is checked on its own range, and
    one refused stripe fails the whole request once, with the refusal's code
    (final: not retried); the connections stay in step for the next one."""
    srv = make_engine("host-srv")
    seg = make_segment(32 * MiB)
    desc = srv.add_local_segment(seg)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def verify(sg: Any, op: TransferOp, off: int, n: int, cap: bytes) -> ErrorCode | None:
        with lock:
            seen.append((off, n))
        return None if off + n <= 16 * MiB else ErrorCode.PERMISSION_DENIED

    assert srv.server is not None and srv.server.bulk is not None
    srv.server.verify_capability = verify
    cli = make_engine("host-cli", overrides={"transports": {"tcp": {"threads": 2,
                                                                    "retries": 1}}})
    cli.add_peer_segment(desc)
    _bulk_port_known(cli, desc.endpoint)
    src = np.random.default_rng(11).integers(0, 256, 24 * MiB, dtype=np.uint8)
    st = cli.transfer([TransferRequest(W, src, desc.segment_id, 0, 16 * MiB)], 30)
    assert st[0].ok and st[0].transport == "tcp", st
    assert sorted(seen) == [(0, 8 * MiB), (8 * MiB, 8 * MiB)]
    assert seg.array()[:16 * MiB].tobytes() == src[:16 * MiB].tobytes()
    dst = np.zeros(16 * MiB + 1, np.uint8)
    st = cli.transfer([TransferRequest(R, dst, desc.segment_id, 0, 16 * MiB,
                                       buffer_offset=1)], 30)
    assert st[0].ok, st
    assert dst[1:].tobytes() == src[:16 * MiB].tobytes()
    # the stripe past 16 MiB is refused: the request fails once, PERMISSION_DENIED
    seen.clear()
    st = cli.transfer([TransferRequest(W, src, desc.segment_id, 0, 24 * MiB)], 30)
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.PERMISSION_DENIED, st
    assert len(st[0].errors) == 1, st  # reported once, and not tried again
    assert any(off + n > 16 * MiB for off, n in seen)
    # the connections stayed in step: the next request goes through
    st = cli.transfer([TransferRequest(R, dst, desc.segment_id, 0, 16 * MiB,
                                       buffer_offset=1)], 30)
    assert st[0].ok and dst[1:].tobytes() == src[:16 * MiB].tobytes()
    # the same for a READ (its stripes' requests all go out before any reply is read)
    seen.clear()
    big = np.zeros(24 * MiB, np.uint8)
    st = cli.transfer([TransferRequest(R, big, desc.segment_id, 0, 24 * MiB)], 30)
    assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.PERMISSION_DENIED, st
    assert len(st[0].errors) == 1, st
    assert sorted(seen) == [(0, 12 * MiB), (12 * MiB, 12 * MiB)]
    dst[:] = 0
    st = cli.transfer([TransferRequest(R, dst, desc.segment_id, 0, 16 * MiB,
                                       buffer_offset=1)], 30)
    assert st[0].ok and dst[1:].tobytes() == src[:16 * MiB].tobytes()


def _serving_conn() -> socket.socket:
    """The connection the calling bulk-server thread serves (from its
    ``_serve_conn`` frame)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_serve_conn":
            return f.f_locals["conn"]  # type: ignore[no-any-return]
        f = f.f_back  # type: ignore[assignment]
    raise AssertionError("not called from a bulk server's connection thread")


def test_large_item_one_connection_cut_fails_once(make_engine: Any,
                                                  make_segment: Any) -> None:
    """One of the two stripe connections of a lone large item cut mid-item (the
    peer stays up): the item fails once, retryably (TRANSFER_FAIL), soon; the
    cut connection is never offered again, and the next request goes through,
    bytes intact."""
    srv = make_engine("host-srv")
    seg = make_segment(40 * MiB)
    desc = srv.add_local_segment(seg)
    assert srv.server is not None and srv.server.bulk is not None
    cut = threading.Event()
    arm = threading.Event()

    def verify(sg: Any, op: TransferOp, off: int, n: int, cap: bytes) -> ErrorCode | None:
        if arm.is_set() and off >= 4 * MiB and not cut.is_set():
            cut.set()
            # the connection this range came on (the serving thread's own): any
            # other may be idle, and cutting it would fail nothing
            victim = _serving_conn()
            # its thread closes it with a reset (an orderly close of a socket shut
            # for reading can leave the sender waiting on a zero window instead)
            victim.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            victim.shutdown(socket.SHUT_RDWR)
        return None

    srv.server.verify_capability = verify
    cli = make_engine("host-cli", overrides={"transports": {"tcp": {"threads": 2,
                                                                    "retries": 0,
                                                                    "timeout_s": 10.0}}})
    cli.add_peer_segment(desc)
    _bulk_port_known(cli, desc.endpoint)
    tcp = cli.transport("tcp")
    n = 32 * MiB
    src = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    for op in (W, R):  # the READ reads what the WRITE's second try wrote
        cut.clear()
        arm.set()
        buf = src if op is W else np.zeros(n, np.uint8)
        t0 = time.monotonic()
        st = cli.transfer([TransferRequest(op, buf, desc.segment_id, 0, n)], 30)
        assert time.monotonic() - t0 < 5.0  # EOF/reset, not the 10 s deadline
        assert cut.is_set()
        assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.TRANSFER_FAIL, st
        assert len(st[0].errors) == 1 and st[0].transport == "tcp", st
        arm.clear()
        with tcp.bulk_peers._lock:  # the cut connection is never offered again
            assert all(not bc.broken for bcs in tcp.bulk_peers.idle.values() for bc in bcs)
        if op is W:
            st = cli.transfer([TransferRequest(W, src, desc.segment_id, 0, n)], 30)
            assert st[0].ok, st
            assert seg.array()[:n].tobytes() == src.tobytes()
        else:
            st = cli.transfer([TransferRequest(R, buf, desc.segment_id, 0, n)], 30)
            assert st[0].ok, st
            assert buf.tobytes() == src.tobytes()


def test_striped_reads_reuse_helper_threads(make_engine: Any, make_peer: Any) -> None:
    """The extra stripes of lone large requests run on helper threads that are
    kept between requests (one here: one extra stripe at a time), bytes intact;
    closing the transport ends them."""
    seg = 24 * MiB
    peer = make_peer(seg, host_id="far-away")
    peer.cmd("fill 5")
    pattern = fill_pattern(5, seg)
    e = make_engine("host-test", overrides={"transports": {"tcp": {"threads": 2}}})
    e.add_peer_segment(peer.desc)
    tcp = _bulk_ready(e, peer)
    helpers = tcp._helpers
    n0 = tcp.stats()["bulk_requests"]
    for i in range(6):
        dst = np.zeros(16 * MiB, np.uint8)
        off = i * 4096 + i
        st = e.transfer([TransferRequest(R, dst, peer.segment_id, off, 16 * MiB)], 30)
        assert st[0].ok and st[0].transport == "tcp", st
        assert zlib.crc32(dst) == zlib.crc32(pattern[off:off + 16 * MiB])
    assert tcp.stats()["bulk_requests"] == n0 + 12  # two stripes each
    with helpers._lock:
        assert len(helpers._idle) == 1, helpers._idle
    mine = [t for t in threading.enumerate() if t.name == "kvpool-tcp-bulk"]
    assert mine
    e.close()
    wait_until(lambda: not any(t.is_alive() for t in mine), 5, "helper threads to exit")


def test_striped_read_from_a_dead_peer_fails_once(make_engine: Any, make_peer: Any) -> None:
    """The stripes' requests of a lone large READ are sent up front: a peer that
    died since the last request fails the request once, retryably, soon (the
    send or the reply read fails; nothing is raised to the caller)."""
    peer = make_peer(32 * MiB, host_id="far-away")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 10.0,
                                                                   "retries": 0,
                                                                   "threads": 2}}})
    e.add_peer_segment(peer.desc)
    _bulk_ready(e, peer)
    dst = np.zeros(16 * MiB, np.uint8)
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, 0, 16 * MiB)], 30)
    assert st[0].ok, st  # both stripe connections now idle in the pool
    peer.kill()
    t0 = time.monotonic()
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, 0, 16 * MiB)], 30)
    assert time.monotonic() - t0 < 5.0  # EOF/reset, not the 10 s deadline
    assert st[0].state is RequestState.FAILED, st
    assert st[0].code in (ErrorCode.TRANSFER_FAIL, ErrorCode.TIMEOUT), st
    assert len(st[0].errors) == 1 and st[0].transport == "tcp", st


def test_lone_large_request_peer_killed_mid_stripes(make_engine: Any, make_peer: Any) -> None:
    """A peer killed while a lone large request moves in stripes over two
    connections: the request fails once, retryably (TRANSFER_FAIL, or TIMEOUT),
    soon after the kill, not at the deadline."""
    peer = make_peer(256 * MiB, host_id="far-away")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 10.0,
                                                                   "retries": 0,
                                                                   "threads": 2}}})
    e.add_peer_segment(peer.desc)
    _bulk_ready(e, peer)
    dst = np.zeros(256 * MiB, np.uint8)
    t0 = time.monotonic()
    h = e.submit([TransferRequest(R, dst, peer.segment_id, 0, 256 * MiB)])
    time.sleep(0.01)
    peer.kill()
    assert h.wait(8.0), "request hung after the peer was killed"
    assert time.monotonic() - t0 < 5.0  # EOF/reset, not the 10 s deadline
    st = h.status()[0]
    assert st.state is RequestState.FAILED, st
    assert st.code in (ErrorCode.TRANSFER_FAIL, ErrorCode.TIMEOUT), st
    assert len(st.errors) == 1 and st.transport == "tcp", st


def test_shared_capability_goes_once_per_request(make_engine: Any, make_segment: Any) -> None:
    """A per-batch token shared by many ranges travels once per bulk request (the
    request's capability table); the server verifies every range with the
    token its index names, and refuses an index outside the table."""
    srv = make_engine("host-srv")
    seg = make_segment(MiB)
    desc = srv.add_local_segment(seg)
    seen: list[tuple[int, int, bytes]] = []

    def verify(sg: Any, op: TransferOp, off: int, n: int, cap: bytes) -> ErrorCode | None:
        seen.append((off, n, cap))
        return None if cap.startswith(b"good") else ErrorCode.PERMISSION_DENIED

    assert srv.server is not None and srv.server.bulk is not None
    srv.server.verify_capability = verify
    bulk = srv.server.bulk
    requests: list[wire.BulkRequest] = []
    check = bulk._check

    def spy(req: wire.BulkRequest) -> Any:
        requests.append(req)
        return check(req)

    bulk._check = spy  # type: ignore[method-assign]
    cli = make_engine("host-cli")
    cli.add_peer_segment(desc)
    _bulk_port_known(cli, desc.endpoint)
    good, bad = b"good" + bytes(600), b"bad" + bytes(600)  # as large as a batch token
    src = np.random.default_rng(3).integers(0, 256, 32 * 4096, dtype=np.uint8)
    reqs = [TransferRequest(W, src, desc.segment_id, i * 4096, 4096, buffer_offset=i * 4096,
                            capability=bad if i == 7 else good) for i in range(32)]
    requests.clear()
    seen.clear()
    st = cli.transfer(reqs, 10)
    assert [s.ok for s in st] == [i != 7 for i in range(32)], st
    assert st[7].code == ErrorCode.PERMISSION_DENIED
    assert len(requests) == 1 and sorted(requests[0].caps) == sorted([good, bad])
    assert all(type(it.cap) is int for it in requests[0].items)
    assert sorted(seen) == sorted((i * 4096, 4096, bad if i == 7 else good) for i in range(32))
    got = seg.array()[:32 * 4096]
    for i in range(32):
        if i != 7:
            assert got[i * 4096:(i + 1) * 4096].tobytes() == src[i * 4096:(i + 1) * 4096].tobytes()
    # a hook set directly is asked for every range, also when all share one token
    seen.clear()
    st = cli.transfer([TransferRequest(W, src, desc.segment_id, i * 4096, 4096,
                                       buffer_offset=i * 4096, capability=good)
                       for i in range(32)], 10)
    assert all(s.ok for s in st) and len(seen) == 32
    # raw: an index outside the table is refused, the others served, the stream in step
    seen.clear()
    r, data = split_reply(raw_exchange("127.0.0.1", bulk.port, frame(wire.BulkRequest(5, int(R), [
        wire.BulkItem(desc.segment_id, 0, 4, 0), wire.BulkItem(desc.segment_id, 0, 4, 3),
        wire.BulkItem(desc.segment_id, 4, 4, good)], caps=[good]))))
    assert r.id == 5 and r.codes == [0, ErrorCode.MALFORMED_FRAME, 0] and "index" in r.err
    assert data == src[:8].tobytes()
    assert seen == [(0, 4, good), (4, 4, good)]


@pytest.mark.parametrize("registered", [False, True], ids=["arrays", "registered"])
def test_batch_token_is_checked_once_and_range_by_range_on_doubt(make_engine: Any,
                                                                 make_segment: Any,
                                                                 registered: bool) -> None:
    """A bulk request whose ranges all share one real batch token: one MAC and
    one check for the request, every byte lands; a range outside its grant
    sends the request to the per-range checks, which refuse that range only
    (with its reason counted) and serve the others; a token of the wrong op
    refuses every range. Registered buffers take the engine's path for a batch
    of requests alike (its first attempt inline, handed to the batch path when
    a range is refused): the same codes and bytes."""
    srv = make_engine("host-srv")
    seg = make_segment(MiB)
    desc = srv.add_local_segment(seg)
    sid = desc.segment_id
    signer = CapabilitySigner()
    srv.set_capability_key(sid, signer.key_for(sid))
    cli = make_engine("host-cli")
    cli.add_peer_segment(desc)
    _bulk_port_known(cli, desc.endpoint)
    flat = [x for i in range(32) for x in (i * 4096, 4096)]
    wtok = signer.grant_ranges(sid, flat, int(CapOp.WRITE), signer.expiry())
    rtok = signer.grant_ranges(sid, flat, int(CapOp.READ), signer.expiry())
    src = np.random.default_rng(5).integers(0, 256, 32 * 4096, dtype=np.uint8)
    v = srv.capabilities
    macs, accepted = v.macs, v.accepted

    def reqs(op: TransferOp, buf: Any, tok: bytes, shift: int = -1) -> list[TransferRequest]:
        if registered:
            buf = cli.register_buffer(buf)
        return [TransferRequest(op, buf, sid, i * 4096 + (8 if i == shift else 0), 4096,
                                buffer_offset=i * 4096, capability=tok) for i in range(32)]

    st = cli.transfer(reqs(W, src, wtok), 10)
    assert all(s.ok and s.transport == "tcp" for s in st), st
    assert seg.array()[:32 * 4096].tobytes() == src.tobytes()
    assert v.macs == macs + 1 and v.accepted == accepted + 32
    assert sum(v.refusals.values()) == 0
    src2 = src[::-1].copy()
    st = cli.transfer(reqs(W, src2, wtok, shift=5), 10)
    assert [s.ok for s in st] == [i != 5 for i in range(32)], st
    assert st[5].code == ErrorCode.PERMISSION_DENIED
    assert v.refusals[DenyReason.OUT_OF_RANGE] == 1 and v.macs == macs + 1
    want = src2.copy()
    want[5 * 4096:6 * 4096] = src[5 * 4096:6 * 4096]  # the refused range left as it was
    assert seg.array()[:32 * 4096].tobytes() == want.tobytes()
    dst = np.zeros(32 * 4096, np.uint8)
    st = cli.transfer(reqs(R, dst, rtok), 10)
    assert all(s.ok for s in st) and dst.tobytes() == want.tobytes()
    dst[:] = 0
    st = cli.transfer(reqs(R, dst, wtok), 10)
    assert all(s.code == ErrorCode.PERMISSION_DENIED for s in st), st
    assert v.refusals[DenyReason.WRONG_OP] == 32 and not dst.any()


def test_frozen_peer_times_out_on_the_bulk_socket(make_engine: Any, make_peer: Any) -> None:
    """A connected but silent peer: the bulk socket's kernel timeouts end a read
    that waits for the reply and a write that fills the socket buffers, at the
    deadline, as TIMEOUT; the next request after it wakes goes through."""
    import os
    import signal

    peer = make_peer(64 * MiB, host_id="far-away")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 1.0,
                                                                   "retries": 0}}})
    e.add_peer_segment(peer.desc)
    tcp = _bulk_ready(e, peer)
    small = np.zeros(4096, np.uint8)
    big = np.zeros(64 * MiB, np.uint8)
    freeze(peer.proc.pid)
    try:
        for req in (TransferRequest(R, small, peer.segment_id, 0, 4096),
                    TransferRequest(W, big, peer.segment_id, 0, 64 * MiB)):
            n0 = tcp.stats()["bulk_requests"]
            t0 = time.monotonic()
            h = e.submit([req])
            assert h.wait(5), "hung on a silent peer"
            # one deadline, not one kernel timeout per partial send
            assert 0.9 < time.monotonic() - t0 < 2.5
            st = h.status()[0]
            assert st.state is RequestState.FAILED and st.code == ErrorCode.TIMEOUT, st
            assert "deadline" in st.errors[-1]
            assert tcp.stats()["bulk_requests"] > n0  # it went over the bulk socket
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    st2 = e.transfer([TransferRequest(R, small, peer.segment_id, 0, 4096)], 5)
    assert st2[0].ok, st2


def test_stream_read_into_waits_for_pieces_and_sees_eof_and_timeouts() -> None:
    """``BulkStream.read_into`` of many small views (one ``MSG_WAITALL`` syscall for
    what the buffer does not hold): a payload that trickles in as pieces of odd
    sizes lands whole and in order; a peer that stops sending runs into the
    deadline (TimeoutError); one that closes mid-payload gives False."""
    from kvpool.transfer.bulk import BulkStream

    payload = np.random.default_rng(11).integers(0, 256, 32 * 4096, dtype=np.uint8).tobytes()
    frame = (3).to_bytes(4, "little") + b"hdr"
    for cut, close in ((len(payload), False), (50_000, False), (50_000, True)):
        a, b = socket.socketpair()
        try:
            stream = BulkStream(b, 1 << 16)

            def send(a: socket.socket = a, cut: int = cut, close: bool = close) -> None:
                a.sendall(frame + payload[:1000])
                for lo in range(1000, cut, 7777):  # odd pieces, each a separate arrival
                    time.sleep(0.002)
                    a.sendall(payload[lo:min(cut, lo + 7777)])
                if close:
                    a.close()

            t = threading.Thread(target=send)
            t.start()
            assert stream.read_frame(1 << 16, time.monotonic() + 5) == b"hdr"
            dst = bytearray(len(payload))
            views = [memoryview(dst)[i * 4096:(i + 1) * 4096] for i in range(32)]
            t0 = time.monotonic()
            if cut == len(payload):
                assert stream.read_into(views, time.monotonic() + 5)
                assert bytes(dst) == payload
            elif close:
                t.join()
                assert not stream.read_into(views, time.monotonic() + 5)
            else:
                with pytest.raises(TimeoutError):
                    stream.read_into(views, time.monotonic() + 0.5)
                assert 0.4 < time.monotonic() - t0 < 3
                assert bytes(dst[:cut]) == payload[:cut]
            t.join()
        finally:
            a.close()
            b.close()


def test_stream_spin_then_block_reads_every_frame() -> None:
    """A reply that comes within the spin window is read by the poll; one that
    comes later by the blocking read; the window is used once, then cleared."""

    from kvpool.transfer.bulk import BulkStream

    a, b = socket.socketpair()
    try:
        stream = BulkStream(a, 1 << 16)
        deadline = time.monotonic() + 5.0
        frames = [frame(wire.BulkReply(k, [0, 0], "")) for k in (1, 2)]

        def send_after(delay: float, data: bytes) -> threading.Thread:
            t = threading.Thread(target=lambda: (time.sleep(delay), b.sendall(data)))
            t.start()
            return t

        # within the window: the poll gets it
        t = send_after(0.01, frames[0])
        stream.spin_until = time.perf_counter() + 2.0
        raw = stream.read_frame(1 << 16, deadline)
        t.join()
        assert raw is not None and wire.decode_bulk_reply(raw).id == 1
        assert stream.spin_until == 0.0
        # after a 1 ms window: the blocking read gets it
        t = send_after(0.05, frames[1])
        stream.spin_until = time.perf_counter() + 0.001
        t0 = time.monotonic()
        raw = stream.read_frame(1 << 16, deadline)
        t.join()
        assert raw is not None and wire.decode_bulk_reply(raw).id == 2
        assert time.monotonic() - t0 >= 0.04
        # a peer that closes during the window: a clean EOF, not an error
        b.shutdown(socket.SHUT_WR)
        stream.spin_until = time.perf_counter() + 1.0
        assert stream.read_frame(1 << 16, deadline) is None
    finally:
        a.close()
        b.close()


def test_small_request_poll_follows_the_reply_wait(make_engine: Any, make_peer: Any) -> None:
    """A bulk connection polls for a small request's reply only while such
    replies have of late come within the window; polling or not, the bytes
    are the same, and the wait is measured either way."""
    peer = make_peer(MiB, host_id="far-away")
    peer.cmd("fill 5")
    pattern = fill_pattern(5, MiB)
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    tcp = _bulk_ready(e, peer)
    dst = np.zeros(4096, np.uint8)
    for k in range(8):
        st = e.transfer([TransferRequest(R, dst, peer.segment_id, k * 4096, 4096)], 10)
        assert st[0].ok and np.array_equal(dst, pattern[k * 4096:(k + 1) * 4096])
    (bc,) = [c for cs in tcp.bulk_peers.idle.values() for c in cs]
    assert 0.0 < bc._reply_wait < 1.0
    bc._reply_wait = 1.0  # "replies came late": block at once
    st = e.transfer([TransferRequest(R, dst, peer.segment_id, 8192, 4096)], 10)
    assert st[0].ok and np.array_equal(dst, pattern[8192:12288])
    assert bc._reply_wait < 1.0  # measured anyway
    # a large request neither polls nor counts
    before = bc._reply_wait
    big = np.zeros(MiB, np.uint8)
    assert e.transfer([TransferRequest(R, big, peer.segment_id, 0, MiB)], 10)[0].ok
    assert np.array_equal(big, pattern) and bc._reply_wait == before


def _congestion(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def test_congestion_policy_on_both_ends(make_engine: Any, make_peer: Any) -> None:
    """``tcp_congestion`` reaches the bulk sockets of both ends: the server's
    accepted connection and the client's, in process and through the engine's
    config; data still arrives byte-exact."""
    from kvpool.transfer.bulk_client import BulkClient
    from kvpool.transfer.bulk_server import BulkServer

    srv = BulkServer("127.0.0.1", lambda op, items, caps: ([], [], None), lambda ok, bad: None,
                     4096, MiB, congestion="reno")
    try:
        cl = BulkClient("127.0.0.1", srv.port, 2.0, congestion="reno")
        wait_until(lambda: len(srv._conns) == 1, 5, "the accepted connection")
        with srv._lock:
            (accepted,) = srv._conns
        assert _congestion(cl.stream.sock) == "reno"
        assert _congestion(accepted) == "reno"
        cl.close()
    finally:
        srv.close()
    peer = make_peer(4 * MiB, host_id="far-away")
    e = make_engine("host-test", overrides={"tcp_congestion": "reno"})
    e.add_peer_segment(peer.desc)
    tcp = _bulk_ready(e, peer)
    src = np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8)
    assert e.transfer([TransferRequest(W, src, peer.segment_id, 0, 4 * MiB)], 30)[0].ok
    assert peer.crc(0, 4 * MiB) == zlib.crc32(src)
    with tcp.bulk_peers._lock:
        clients = list(tcp.bulk_peers.clients)
    assert clients and all(_congestion(c.stream.sock) == "reno" for c in clients)


def test_congestion_auto_leaves_bbr_only() -> None:
    """``auto`` moves a BBR socket to cubic (or reno) and keeps any other;
    ``system`` and a refused name change nothing and raise nothing."""
    from kvpool.transfer.bulk import set_congestion

    with socket.socket() as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
        assert set_congestion(s, "auto") == "reno" == _congestion(s)
        assert set_congestion(s, "system") == "" and _congestion(s) == "reno"
        assert set_congestion(s, "no_such_cc") == "reno" == _congestion(s)
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
        except OSError as exc:
            pytest.skip(f"this kernel does not let this process use bbr ({exc}); the "
                        "non-BBR cases above ran")
        chosen = set_congestion(s, "auto")
        assert chosen in ("cubic", "reno") and _congestion(s) == chosen


def test_congestion_setting_is_checked() -> None:
    from kvpool.core.config import ConfigError
    from kvpool.transfer.config import load_transfer_config

    assert load_transfer_config().tcp_congestion == "auto"
    assert load_transfer_config(overrides={"tcp_congestion": "dctcp"}).tcp_congestion == "dctcp"
    with pytest.raises(ConfigError, match="tcp_congestion"):
        load_transfer_config(overrides={"tcp_congestion": "BBR; rm"})
