"""Integration: the ops behind Mooncake's upsert, soft-pin TTL, replica clear
and copy/move tasks, against a real ``kvpool master`` subprocess: results,
journal (a restart keeps what they changed) and malformed requests (typed
error codes; the master keeps serving)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    BatchReplicaClear,
    BatchUpsertStart,
    CreateCopyTask,
    CreateMoveTask,
    GetReplicaList,
    MountSegment,
    Op,
    Ping,
    PutEnd,
    PutOptions,
    PutStart,
    QueryTask,
    Remove,
    Stats,
    TierTaskDone,
    UpsertStart,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from support.factories import segment_desc


def code_of(fn: Any, *a: Any) -> int:
    with pytest.raises(MasterRPCError) as ei:
        fn(*a)
    return int(ei.value.code)


def mount(c: MasterClient, sid: str, client_id: str) -> None:
    c.call(MountSegment(client_id, segment_desc(sid, client_id)))


def segs(c: MasterClient, key: str) -> list[str]:
    return sorted(r.segment_id for r in c.call(GetReplicaList(key)).replicas)


def test_upsert_replica_clear_and_tasks_survive_restart(tmp_path: Path) -> None:
    port = find_free_port()
    with MasterProcess(data_dir=str(tmp_path / "d"), lease_ttl_ms=200, metrics_port=port) as m:
        with m.client() as c:
            for sid, cid in (("a", "c1"), ("b", "c2"), ("c", "c3")):
                mount(c, sid, cid)
            one = PutOptions(preferred_segments=["a"])
            c.call(PutStart("c1", "k", 100, one))
            c.call(PutEnd("c1", "k"))
            # upsert: a new, bigger object; the old one is readable until PUT_END
            r = c.call(UpsertStart("c1", "k", 300, one))
            assert r.replicas[0].length == 300
            assert c.call(GetReplicaList("k")).size == 100
            c.call(PutEnd("c1", "k"))
            assert c.call(GetReplicaList("k")).size == 300
            b = c.call(BatchUpsertStart("c1", ["k", "fresh"], [64, 64], one))
            assert b.codes == [0, 0]
            assert c.call(BatchPutEnd("c1", ["k", "fresh"])).codes == [0, 0]
            assert c.call(Stats()).replaced == 2
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            assert b"kvpool_master_replaced_objects_total 2.0" in text
            # copy to b and c: handed to the owner of a's replica (c1) in its ping
            tid = c.call(CreateCopyTask("k", ["b", "c"])).task_id
            q = c.call(QueryTask(tid))
            assert (q.status, q.move, q.key, q.executor) == (0, False, "k", "c1")
            tasks = c.call(Ping("c1")).tasks
            assert sorted(t.dst_id for t in tasks) == ["b", "c"]
            assert c.call(QueryTask(tid)).status == 1  # processing
            for t in tasks:
                assert (t.src_id, t.size) == ("a", 64)
                c.call(TierTaskDone("c1", t.id, True))
            assert c.call(QueryTask(tid)).status == 3  # success
            assert segs(c, "k") == ["a", "b", "c"]
            # move b -> back onto nothing new: c holds one, so only b's goes
            tid = c.call(CreateMoveTask("k", "b", "c")).task_id
            assert c.call(QueryTask(tid)).status == 3
            assert segs(c, "k") == ["a", "c"]
            # move a -> b through a task run by a's owner
            tid = c.call(CreateMoveTask("fresh", "a", "b")).task_id
            (t,) = c.call(Ping("c1")).tasks
            c.call(TierTaskDone("c1", t.id, True))
            q = c.call(QueryTask(tid))
            assert (q.status, q.move) == (3, True) and q.updated_ms >= q.created_ms
            assert segs(c, "fresh") == ["b"]
            # replica clear: the writer only, once the read lease ended
            time.sleep(0.3)
            assert c.call(BatchReplicaClear("c9", ["k"], "c")).codes == \
                [ErrorCode.PERMISSION_DENIED]
            assert c.call(BatchReplicaClear("c1", ["k", "nope", ""], "c")).codes == \
                [0, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_KEY]
            assert segs(c, "k") == ["a"]
        m.restart()
        with m.client() as c:
            for cid in ("c1", "c2", "c3"):
                c.call(Ping(cid))
            got = c.call(BatchGetReplicaList(["k", "fresh"]))
            assert got.codes == [0, 0] and got.sizes == [64, 64]
            assert [[r.segment_id for r in reps] for reps in got.replicas] == [["a"], ["b"]]
            # task state is not journaled: an old id is unknown after a restart
            assert code_of(c.call, QueryTask(tid)) == ErrorCode.TASK_NOT_FOUND


def test_task_errors_and_malformed_requests(mclient: MasterClient) -> None:
    c = mclient
    mount(c, "a", "c1")
    mount(c, "b", "c2")
    c.call(PutStart("c1", "k", 100, PutOptions(preferred_segments=["a"])))
    c.call(PutEnd("c1", "k"))
    bad = [
        (CreateCopyTask("nope", ["b"]), ErrorCode.OBJECT_NOT_FOUND),
        (CreateCopyTask("k", ["unknown_segment"]), ErrorCode.INVALID_PARAMS),
        (CreateCopyTask("k", []), ErrorCode.INVALID_PARAMS),
        (CreateMoveTask("k", "unknown", "b"), ErrorCode.INVALID_PARAMS),
        (CreateMoveTask("k", "a", "unknown"), ErrorCode.INVALID_PARAMS),
        (CreateMoveTask("k", "a", "a"), ErrorCode.INVALID_PARAMS),
        (CreateMoveTask("k", "", "b"), ErrorCode.INVALID_PARAMS),
        (QueryTask(12345), ErrorCode.TASK_NOT_FOUND),
        (UpsertStart("c1", "k", 0), ErrorCode.INVALID_PARAMS),
        (UpsertStart("", "k", 10), ErrorCode.INVALID_PARAMS),
        (UpsertStart("c1", "k", 10, PutOptions(soft_pin=True, soft_pin_ttl_ms=1 << 40)),
         ErrorCode.INVALID_PARAMS),
        (PutStart("c1", "k2", 10, PutOptions(soft_pin_ttl_ms=5)), ErrorCode.INVALID_PARAMS),
        (PutStart("c1", "k2", 10, PutOptions(soft_pin=True, soft_unpin=True)),
         ErrorCode.INVALID_PARAMS),
        (BatchReplicaClear("", ["k"]), ErrorCode.INVALID_PARAMS),
        (BatchPutStart("c1", ["g"], [10], None, None, ["a", "b"]), ErrorCode.INVALID_PARAMS),
        (PutStart("c1", "g", 10, None, None, "x" * 5000), ErrorCode.INVALID_PARAMS),
        (UpsertStart("c1", "k", 10, None, None, "a-group"), ErrorCode.INVALID_PARAMS),
    ]
    for req, code in bad:
        assert code_of(c.call, req) == code, req
    raw = [
        (Op.CREATE_COPY_TASK, ["k", "b"], ErrorCode.INVALID_PARAMS),  # targets not a list
        (Op.CREATE_COPY_TASK, [7, ["b"]], ErrorCode.INVALID_KEY),
        (Op.CREATE_MOVE_TASK, ["k", "a"], ErrorCode.INVALID_PARAMS),
        (Op.QUERY_TASK, ["1"], ErrorCode.INVALID_PARAMS),
        (Op.QUERY_TASK, [], ErrorCode.INVALID_PARAMS),
        (Op.UPSERT_START, ["c1", "k", "big"], ErrorCode.INVALID_PARAMS),
        (Op.BATCH_UPSERT_START, ["c1", ["a"], [1, 2]], ErrorCode.INVALID_PARAMS),
        (Op.BATCH_REPLICA_CLEAR, ["c1", "k"], ErrorCode.INVALID_KEY),
        (Op.BATCH_REPLICA_CLEAR, ["c1", ["k"], 3], ErrorCode.INVALID_PARAMS),
        (Op.BATCH_PUT_START, ["c1", ["g"], [10], None, None, [7]], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["c1", "g", 10, None, None, ["grp"]], ErrorCode.INVALID_PARAMS),
    ]
    for op, args, code in raw:
        assert code_of(c.call_raw, op, args) == code, (op, args)
    # still serving, and nothing changed
    assert segs(c, "k") == ["a"]
    assert c.call(Stats()).objects == 1
    # object groups: a read of one member leases the others
    assert c.call(BatchPutStart("c1", ["g1", "g2", "u"], [8, 8, 8], None, None,
                                ["grp", "grp", ""])).codes == [0, 0, 0]
    c.call(BatchPutEnd("c1", ["g1", "g2", "u"]))
    assert c.call(Stats()).groups == 1
    c.call(GetReplicaList("g1"))
    assert code_of(c.call, Remove("g2")) == ErrorCode.OBJECT_HAS_LEASE
    c.call(Remove("u"))
