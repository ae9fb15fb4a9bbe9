"""The typed protocol and the master's rooms without sockets: the op table is
code (and the docs carry it), the handlers run on bytes in / bytes out, the
durability room hands every group commit to its listeners in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvpool.core.capability import CapabilitySigner, CapOp, verify
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    OPS,
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    MountSegment,
    Op,
    Ping,
    PingReply,
    PutOptions,
    Request,
    Stats,
    decode_reply,
    decode_request,
    encode_frame,
    encode_request,
    op_table_markdown,
)
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory, Rec
from kvpool.master.durability import Durability
from kvpool.master.handlers import OpHandlers
from kvpool.master.journal import list_journals, read_journal
from kvpool.master.tiering import TieringPolicy
from support.factories import segment_desc

DOCS = Path(__file__).resolve().parents[2] / "docs" / "INTERFACES.md"


def _handlers(capabilities: bool = True) -> OpHandlers:
    cfg = MasterConfig(port=0)
    tiering = TieringPolicy(cfg.tiering)
    signer = CapabilitySigner(cfg.lease_ttl_ms) if capabilities else None
    return OpHandlers(cfg, Directory(cfg, hooks=tiering), tiering, signer)


def test_op_table_is_code_and_in_the_docs() -> None:
    assert set(OPS) == set(Op)  # every op has a schema
    run = _handlers()._run  # each op served by the method of its name in one group
    for op, spec in OPS.items():
        assert spec.request.OP is op
        assert issubclass(spec.request, Request)
        assert run[int(op)][1].__name__ == spec.handler_name
    assert op_table_markdown() in DOCS.read_text(), \
        "docs/INTERFACES.md is stale: paste `python -m kvpool.core.protocol`"


def test_frames_round_trip_and_bad_frames_are_typed() -> None:
    rid, spec, req = decode_request(encode_request(7, Stats()))
    assert (rid, spec.op, req) == (7, Op.STATS, Stats())
    cases: list[tuple[bytes, ErrorCode]] = [
        (b"\xc1", ErrorCode.MALFORMED_FRAME),
        (msgpack.packb({"op": 1, "id": 1, "args": {}}), ErrorCode.MALFORMED_FRAME),
        (encode_frame([999, 1, []]), ErrorCode.UNKNOWN_OP),
        (encode_frame([int(Op.PING), 1, [5]]), ErrorCode.INVALID_PARAMS),
        (encode_frame([int(Op.EXIST), 1, [5]]), ErrorCode.INVALID_KEY),
        (encode_frame([int(Op.BATCH_EXIST), 1, [["a", None]]]), ErrorCode.INVALID_KEY),
        (encode_frame([int(Op.PUT_START), 1, ["c", "k"]]), ErrorCode.INVALID_PARAMS),
    ]
    for frame, code in cases:
        with pytest.raises(KVPoolError) as ei:
            decode_request(frame)
        assert ei.value.code == code, frame
    with pytest.raises(KVPoolError) as ei:
        decode_request(b"\x93" + b"\x00" * 100, max_size=50)
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE


def test_handlers_serve_bytes_without_sockets() -> None:
    h = _handlers()
    key = h.handle(MountSegment("c1", segment_desc("s1", "c1"))).capability_key  # type: ignore[attr-defined]
    put = h.handle(BatchPutStart("c1", ["a", "b", ""], [100, 200, 1],
                                 PutOptions(replica_num=1)))
    assert put.codes == [0, 0, ErrorCode.INVALID_KEY]  # type: ignore[attr-defined]
    assert h.handle(BatchPutEnd("c1", ["a", "b"])).codes == [0, 0]  # type: ignore[attr-defined]
    assert h.dir.records and h.dir.records[-1][0] == Rec.PUT  # committed by the caller
    # the same through bytes, as the event loop runs it
    reply = decode_reply(h.handle_payload(encode_request(3, BatchGetReplicaList(["a", "b"]))))
    assert reply.id == 3 and reply.code == 0
    got = OPS[Op.BATCH_GET_REPLICA_LIST].reply_decoder.decode(reply.result)
    assert got.sizes == [100, 200] and len(got.caps) == 1  # one READ token for the batch
    for reps, size in zip(got.replicas, got.sizes, strict=True):
        (r,) = reps
        verify(got.caps[r.cap], key, "s1", r.offset, size, CapOp.READ)
    # errors are replies, never exceptions; counted by op and code
    bad = decode_reply(h.handle_payload(encode_frame([int(Op.PING), 4, [""]])))
    assert (bad.id, bad.code) == (4, ErrorCode.INVALID_PARAMS)
    junk = decode_reply(h.handle_payload(b"\xc1junk"))
    assert (junk.id, junk.code) == (None, ErrorCode.MALFORMED_FRAME)
    assert h.counters.errors[("PING", "INVALID_PARAMS")] == 1
    assert h.counters.key_ops["put_start"] == 3
    ping = decode_reply(h.handle_payload(encode_frame([int(Op.PING), 5, ["c1"]])))
    assert OPS[Op.PING].reply_decoder.decode(ping.result) == PingReply(False, ["s1"])
    # the guard's heartbeat: known or not, never tasks, never a remount
    assert h.handle(Ping("c1", heartbeat=True)) == PingReply(False, known=True)
    assert h.handle(Ping("nobody", heartbeat=True)) == PingReply(False, known=False)
    st = h.admin.stats()
    assert st.objects == 2 and st.suspect_segments == 0
    assert st.extra == {}  # every directory counter has its typed field


def test_capabilities_off_grants_nothing() -> None:
    h = _handlers(capabilities=False)
    assert h.handle(MountSegment("c1", segment_desc("s1", "c1"))).capability_key == b""  # type: ignore[attr-defined]
    put = h.handle(BatchPutStart("c1", ["a"], [10]))
    assert put.caps == [] and put.replicas[0][0].cap == -1  # type: ignore[attr-defined]


def test_tokens_split_at_max_ranges_and_stay_exact() -> None:
    from kvpool.core.capability import MAX_RANGES

    h = _handlers()
    key = h.handle(MountSegment("c1", segment_desc("s1", "c1", 64 << 20))).capability_key  # type: ignore[attr-defined]
    n = 2 * MAX_RANGES + 5
    put = h.handle(BatchPutStart("c1", [f"k{i}" for i in range(n)], [64] * n))
    assert len(put.caps) == 3 and h.signer is not None and h.signer.granted == 3  # type: ignore[attr-defined]
    for reps in put.replicas:  # type: ignore[attr-defined]
        (r,) = reps
        verify(put.caps[r.cap], key, "s1", r.offset, 64, CapOp.WRITE)  # type: ignore[attr-defined]


def test_durability_hands_commits_to_listeners_in_order(tmp_path: Path) -> None:
    cfg = MasterConfig(port=0, data_dir=str(tmp_path / "d"), journal_fsync=FsyncPolicy.ALWAYS)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    seen: list[tuple[int, list[Any]]] = []
    dur.add_listener(lambda records, batch: seen.append((batch, list(records))))
    d.mount("c1", segment_desc("s1", "c1"))
    d.put_start("c1", "k", 10)
    d.put_end("c1", "k")
    first = list(d.records)
    dur.commit(d.records)
    assert d.records == [] and seen == [(1, first)]
    dur.commit(d.records)  # nothing new: no empty batch reaches the listeners
    d.remove("k", force=True)
    dur.commit(d.records)
    assert [b for b, _ in seen] == [1, 2] and seen[1][1][0][0] == Rec.REMOVE
    dur.close(d.records)
    # the listeners saw exactly what the journal holds, in the same order
    ((_seq, path),) = list_journals(cfg.data_dir or "")
    records, torn = read_journal(path)
    assert not torn and records == [r for _, batch in seen for r in batch]


def test_ack_gate_holds_replies_until_their_commit_is_acknowledged() -> None:
    import threading

    from kvpool.core.protocol import Exist, PutEnd, PutStart
    from kvpool.core.rpc_client import MasterClient, MasterRPCError
    from kvpool.master.server import MasterServer

    server = MasterServer(MasterConfig(port=0, local_socket="off"))
    acked = [0]
    seen: list[int] = []
    server.durability.add_listener(lambda records, no: seen.append(no))
    server.durability.set_ack_gate(lambda: acked[0])
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    try:
        with MasterClient(f"127.0.0.1:{server.port}", timeout_s=5) as c:
            c.call(Exist("nothing"))  # no change committed yet: acked 0 covers it
            with pytest.raises(MasterRPCError) as ei:  # commit 1 (the mount) is not acked
                c.call(MountSegment("c1", segment_desc("s1", "c1")), timeout_s=0.3)
            assert ei.value.code == ErrorCode.RPC_TIMEOUT and seen == [1]
            acked[0] = 1
            c.call(PutStart("c1", "k", 10))  # nothing journaled: still commit 1
            result: list[Any] = []
            t = threading.Thread(target=lambda: result.append(c.call(PutEnd("c1", "k"))))
            t.start()
            t.join(0.3)
            assert t.is_alive() and not result and seen == [1, 2]  # held behind commit 2
            acked[0] = 2
            t.join(5)
            assert result and c.call(Exist("k")).exists
    finally:
        server.stop()
        loop.join(5)
        server.close()
