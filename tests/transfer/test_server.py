"""The transfer server under hostile input: raw DEALER frames over real sockets.
Every bad request gets a typed error reply and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvpool.core.errors import ErrorCode
from kvpool.transfer import TransferEngine, TransferOp
from kvpool.transfer.segment import LocalSegment, MemorySegment
from kvpool.transfer.server import OP_PING


@pytest.fixture
def served(make_engine: Any, make_segment: Any) -> Iterator[tuple[TransferEngine, MemorySegment,
                                                                   zmq.Socket]]:
    e = make_engine()
    seg = make_segment(65536)
    e.add_local_segment(seg)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 3000)
    s.connect(e.endpoint)
    yield e, seg, s
    s.close(0)
    ctx.term()


def _call(s: zmq.Socket, *frames: bytes) -> tuple[dict[str, Any], list[bytes]]:
    s.send_multipart(list(frames))
    reply = s.recv_multipart()
    return msgpack.unpackb(reply[0]), reply[1:]


def _hdr(**kw: Any) -> bytes:
    base = {"op": int(TransferOp.READ), "id": 1, "seg": "", "off": 0, "len": 4, "cap": b""}
    base.update(kw)
    return msgpack.packb(base)


def test_valid_read_write_and_ping(served: Any) -> None:
    _, seg, s = served
    r, p = _call(s, _hdr(op=int(TransferOp.WRITE), seg=seg.segment_id, off=10, len=3), b"xyz")
    assert r == {"id": 1, "code": 0, "err": ""} and p == []
    assert seg.array()[10:13].tobytes() == b"xyz"
    r, p = _call(s, _hdr(seg=seg.segment_id, off=9, len=5, id=2))
    assert r["code"] == 0 and r["id"] == 2 and p == [b"\0xyz\0"]
    r, _ = _call(s, _hdr(op=OP_PING, id=3))
    assert r["code"] == 0 and r["id"] == 3


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1\xc1garbage"], ErrorCode.MALFORMED_FRAME),
    ([msgpack.packb([1, 2, 3])], ErrorCode.MALFORMED_FRAME),
    ([b"x" * 5000], ErrorCode.FRAME_TOO_LARGE),
    ([_hdr(op=99, seg="S")], ErrorCode.UNKNOWN_OP),
    ([_hdr(op=True, seg="S")], ErrorCode.MALFORMED_FRAME),  # a bool is no op number
    ([_hdr(seg="S", id="7")], ErrorCode.MALFORMED_FRAME),
    ([msgpack.packb({"id": 1})], ErrorCode.MALFORMED_FRAME),  # no op
    ([_hdr(seg=5)], ErrorCode.MALFORMED_FRAME),
    ([_hdr(seg="S", off="0")], ErrorCode.MALFORMED_FRAME),
    ([_hdr(seg="S", off=True)], ErrorCode.MALFORMED_FRAME),
    ([_hdr(seg="S", cap="text")], ErrorCode.MALFORMED_FRAME),
    ([_hdr(seg="no-such-segment")], ErrorCode.SEGMENT_NOT_FOUND),
    ([_hdr(seg="S", off=65534, len=4)], ErrorCode.OUT_OF_BOUNDS),
    ([_hdr(seg="S", off=-1, len=4)], ErrorCode.OUT_OF_BOUNDS),
    ([_hdr(seg="S", off=0, len=-4)], ErrorCode.OUT_OF_BOUNDS),
    ([_hdr(seg="S", off=0, len=1 << 40)], ErrorCode.FRAME_TOO_LARGE),
    ([_hdr(op=int(TransferOp.WRITE), seg="S", len=4)], ErrorCode.MALFORMED_FRAME),
    ([_hdr(op=int(TransferOp.WRITE), seg="S", len=4), b"toolong"], ErrorCode.MALFORMED_FRAME),
    ([_hdr(op=int(TransferOp.WRITE), seg="S", len=4), b"ab"], ErrorCode.MALFORMED_FRAME),
])
def test_bad_requests_get_error_replies(served: Any, frames: list[bytes],
                                        code: ErrorCode) -> None:
    _, seg, s = served
    frames = [f.replace(b"\xa1S", msgpack.packb(seg.segment_id)) for f in frames]
    before = seg.array()[:8].tobytes()
    r, payload = _call(s, *frames)
    assert r["code"] == int(code), r
    assert payload == [] and r["err"]
    assert seg.array()[:8].tobytes() == before or code == ErrorCode.MALFORMED_FRAME
    # still serving
    r, p = _call(s, _hdr(seg=seg.segment_id, id=77))
    assert r["code"] == 0 and r["id"] == 77 and len(p[0]) == 4


def test_refusal_echoes_a_readable_id(served: Any) -> None:
    _, _, s = served
    r, _ = _call(s, _hdr(seg=5, id=41))  # mistyped field, readable id
    assert r["code"] == int(ErrorCode.MALFORMED_FRAME) and r["id"] == 41
    r, _ = _call(s, _hdr(seg=5, id="41"))
    assert r["code"] == int(ErrorCode.MALFORMED_FRAME) and r["id"] is None


def test_empty_multipart_identity_only(served: Any) -> None:
    _, _, s = served
    r, _ = _call(s, b"")  # an empty header frame
    assert r["code"] == int(ErrorCode.MALFORMED_FRAME)


def test_op_not_allowed_on_segment(served: Any) -> None:
    _, seg, s = served
    seg.allowed_ops = frozenset({TransferOp.READ})
    r, _ = _call(s, _hdr(op=int(TransferOp.WRITE), seg=seg.segment_id, len=2), b"ab")
    assert r["code"] == int(ErrorCode.PERMISSION_DENIED)
    r, p = _call(s, _hdr(seg=seg.segment_id, len=2))
    assert r["code"] == 0 and len(p[0]) == 2


def test_capability_hook_is_called_per_request(served: Any) -> None:
    e, seg, s = served
    seen: list[tuple[str, TransferOp, int, int, bytes]] = []

    def verify(sg: LocalSegment, op: TransferOp, off: int, n: int,
               cap: bytes) -> ErrorCode | None:
        seen.append((sg.segment_id, op, off, n, cap))
        return None if cap == b"good" else ErrorCode.PERMISSION_DENIED

    assert e.server is not None
    e.server.verify_capability = verify
    r, _ = _call(s, _hdr(seg=seg.segment_id, off=8, len=4, cap=b"bad"))
    assert r["code"] == int(ErrorCode.PERMISSION_DENIED)
    r, p = _call(s, _hdr(seg=seg.segment_id, off=8, len=4, cap=b"good"))
    assert r["code"] == 0 and len(p[0]) == 4
    assert seen == [(seg.segment_id, TransferOp.READ, 8, 4, b"bad"),
                    (seg.segment_id, TransferOp.READ, 8, 4, b"good")]


def test_removed_segment_is_no_longer_served(served: Any) -> None:
    e, seg, s = served
    e.remove_local_segment(seg.segment_id)
    r, _ = _call(s, _hdr(seg=seg.segment_id))
    assert r["code"] == int(ErrorCode.SEGMENT_NOT_FOUND)


def test_engine_without_server_keeps_its_capability_state(make_engine: Any,
                                                          make_segment: Any) -> None:
    """With ``server.enabled`` false nothing listens (no server, no endpoint, no
    bulk offer in descriptors), yet the segment server keeps the capability
    state the store hands it: keys, the master's epoch, the stats."""
    e = make_engine(overrides={"server": {"enabled": False}})
    assert e.server is None and e.endpoint == ""
    desc = e.add_local_segment(make_segment(4096))
    assert "bulk" not in desc.extra and desc.endpoint == ""
    e.set_capability_key(desc.segment_id, b"k" * 32)
    assert e.capabilities.has_key(desc.segment_id)
    e.observe_master_epoch(3)
    assert e.capability_stats()["capability_epoch"] == 3
    e.remove_local_segment(desc.segment_id)
    assert not e.capabilities.has_key(desc.segment_id)
