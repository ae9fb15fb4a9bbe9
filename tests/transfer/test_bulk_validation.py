"""The bulk path's per-request validation with real capabilities: segment
checks once per segment and request, every range still checked on its own
(bounds, size, capability), per-range codes, counters, one MAC per token."""

from __future__ import annotations

from typing import Any

import numpy as np
import zmq

from kvpool.core.capability import CapabilitySigner, CapOp
from kvpool.core.errors import ErrorCode
from kvpool.transfer import TransferOp, wire
from support.bulk import exchange, frame, split_reply
from support.wait import wait_until

MiB = 1 << 20
W = TransferOp.WRITE


def test_bulk_request_ranges_checked_one_by_one(make_engine: Any, make_segment: Any) -> None:
    srv = make_engine("host-srv")
    a, b = make_segment(MiB), make_segment(MiB)
    da, db = srv.add_local_segment(a), srv.add_local_segment(b)
    sa, sb = da.segment_id, db.segment_id
    signer = CapabilitySigner()
    srv.set_capability_key(sa, signer.key_for(sa))
    srv.set_capability_key(sb, signer.key_for(sb))
    server = srv.server
    assert server is not None and server.bulk is not None
    exp = signer.expiry()
    tok_a = signer.grant_ranges(sa, [0, 4096, 4096, 4096, MiB - 4096, 8192], int(CapOp.WRITE),
                                exp)
    tok_b = signer.grant_ranges(sb, [0, 4096], int(CapOp.WRITE), exp)
    read_a = signer.grant_ranges(sa, [8192, 4096], int(CapOp.READ), exp)
    items = [
        wire.BulkItem(sa, 0, 4096, 0),  # ok
        wire.BulkItem(sb, 0, 4096, 1),  # ok, the other segment's token
        wire.BulkItem(sa, 4096, 4096, 0),  # ok
        wire.BulkItem(sb, 4096, 4096, 1),  # outside tok_b's grant
        wire.BulkItem(sa, 8192, 4096, 2),  # a READ token for a WRITE
        wire.BulkItem(sb, 0, 4096, 0),  # segment A's token on segment B
        wire.BulkItem("nope", 0, 4096, 0),  # not owned here
        wire.BulkItem(sa, MiB - 4096, 8192, 0),  # granted, but past the segment's end
        wire.BulkItem(sa, 0, 16, 9),  # an index outside the table
        wire.BulkItem(sa, 100, 16, 0),  # ok: inside the first grant
    ]
    want = [0, 0, 0, ErrorCode.PERMISSION_DENIED, ErrorCode.PERMISSION_DENIED,
            ErrorCode.PERMISSION_DENIED, ErrorCode.SEGMENT_NOT_FOUND, ErrorCode.OUT_OF_BOUNDS,
            ErrorCode.MALFORMED_FRAME, 0]
    served, refused = server.requests_served, server.requests_refused
    ver = srv.capabilities
    macs, denied = ver.macs, ver.refused_total
    payload = [np.full(it.len, i + 1, np.uint8).tobytes() for i, it in enumerate(items)]
    # only the segment-checked ranges carry trustworthy lengths: all of them here
    data = frame(wire.BulkRequest(3, int(W), items, caps=[tok_a, tok_b, read_a]))
    data += b"".join(payload)
    data += frame(wire.BulkRequest(4, int(W), [wire.BulkItem(sa, 4096, 4096, 0)],
                                    caps=[tok_a])) + b"\xee" * 4096
    rep, rest = split_reply(exchange("127.0.0.1", server.bulk.port, data))
    assert rep.id == 3 and rep.codes == [int(c) for c in want], rep
    assert rep.err  # the first refusal's reason
    n = int.from_bytes(rest[:4], "little")
    assert wire.decode_bulk_reply(rest[4:4 + n]).codes == [0]  # the stream stayed in step
    assert server.requests_served - served == 4 + 1 and server.requests_refused - refused == 6
    # accepted ranges landed, refused ones did not touch either segment
    arr_a, arr_b = a.array(), b.array()
    assert (arr_a[100:116] == 10).all() and (arr_a[:100] == 1).all()
    assert (arr_a[4096:8192] == 0xEE).all()  # the second request overwrote item 2
    assert (arr_b[:4096] == 2).all() and not arr_b[4096:8192].any()
    assert not arr_a[8192:12288].any() and not arr_a[MiB - 4096:].any()
    # three tokens, each verified once (the second request's tok_a from the cache)
    assert ver.macs - macs == 3
    assert ver.refused_total - denied == 3  # out of range, wrong op, wrong segment


def test_zeromq_and_bulk_requests_get_the_same_verdicts(make_engine: Any,
                                                        make_segment: Any) -> None:
    """One validator serves both loops: every range sent alone over ZeroMQ and
    all of them in one bulk request get the same code, and the counters move
    alike (an unknown op included)."""
    srv = make_engine("host-srv")
    a, ro = make_segment(MiB), make_segment(MiB)
    sa, sro = srv.add_local_segment(a).segment_id, srv.add_local_segment(ro).segment_id
    ro.allowed_ops = frozenset({W})  # READ refused
    signer = CapabilitySigner()
    srv.set_capability_key(sa, signer.key_for(sa))
    tok = signer.grant_ranges(sa, [0, 4096, 8192, 4096], int(CapOp.READ), signer.expiry())
    cases = [
        ((sa, 0, 4096, tok), 0),
        ((sa, 4096, 4096, tok), ErrorCode.PERMISSION_DENIED),  # outside the grant
        ((sa, MiB - 16, 32, tok), ErrorCode.OUT_OF_BOUNDS),
        (("nope", 0, 16, tok), ErrorCode.SEGMENT_NOT_FOUND),
        ((sro, 0, 16, b""), ErrorCode.PERMISSION_DENIED),  # READ not allowed there
        ((sa, 0, 128 * MiB, tok), ErrorCode.FRAME_TOO_LARGE),
        ((sa, 8192, 4096, b""), ErrorCode.PERMISSION_DENIED),  # no capability
        ((sa, 8192, 4096, tok), 0),
    ]
    server = srv.server
    assert server is not None and server.bulk is not None
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(srv.endpoint)

    def over_zmq(op: int, seg: str, off: int, n: int, cap: bytes) -> int:
        s.send(wire.encode(wire.ServerRequest(op, 1, seg, off, n, cap)))
        return wire.decode_reply(s.recv_multipart()[0]).code

    def over_bulk(op: int) -> list[int]:
        items = [wire.BulkItem(*c) for c, _ in cases]
        rep, _ = split_reply(exchange("127.0.0.1", server.bulk.port,
                                      frame(wire.BulkRequest(2, op, items))))
        return rep.codes

    try:
        for op, want in ((int(TransferOp.READ), [int(c) for _, c in cases]),
                         (9, [int(ErrorCode.UNKNOWN_OP)] * len(cases))):
            served, refused = server.requests_served, server.requests_refused
            got = [over_zmq(op, *c) for c, _ in cases]
            assert got == want
            ok = want.count(0)  # (a reply may come before its request is counted)
            wait_until(lambda s0=served, k=ok: server.requests_served - s0 == k, 5,
                       "the ZeroMQ requests counted")
            assert server.requests_refused - refused == len(want) - ok
            assert over_bulk(op) == want
            assert server.requests_served - served == 2 * ok
            assert server.requests_refused - refused == 2 * (len(want) - ok)
    finally:
        s.close(0)
        ctx.term()
