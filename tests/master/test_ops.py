"""Integration: every op of the protocol table (and its errors) against a real
``kvpool master`` subprocess through MasterClient."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from kvpool.cluster.processes import MasterProcess
from kvpool.core.capability import CapabilityError, CapOp, verify
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import Op, SegmentKind, decode_frame, encode_frame
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from support.factories import segment_wire

MEM = SegmentKind.MEMORY
FILE = SegmentKind.FILE


def mount(c: MasterClient, sid: str, client_id: str = "c1", size: int = 1 << 20,
          kind: SegmentKind = MEM) -> bytes:
    """Mount; return the segment's capability key from the reply (issue 7)."""
    r = c.call(Op.MOUNT_SEGMENT, client_id=client_id,
               segment=segment_wire(sid, client_id, size, kind))
    return bytes(r["capability_key"])


def put(c: MasterClient, key: str, size: int = 100, client_id: str = "c1",
        **kw: Any) -> dict[str, Any]:
    r = c.call(Op.PUT_START, client_id=client_id, key=key, size=size, **kw)
    c.call(Op.PUT_END, client_id=client_id, key=key)
    return r


def code_of(fn: Any, *a: Any, **kw: Any) -> int:
    with pytest.raises(MasterRPCError) as ei:
        fn(*a, **kw)
    return int(ei.value.code)


def test_ping_remount_and_segments(mclient: MasterClient) -> None:
    c = mclient
    assert c.call(Op.PING, client_id="c1") == {"remount": True, "segment_ids": []}
    assert c.call(Op.PING, client_id="c1")["remount"] is False
    mount(c, "s1")
    mount(c, "s2")
    assert c.call(Op.PING, client_id="c1") == {"remount": False, "segment_ids": ["s1", "s2"]}
    assert code_of(mount, c, "s1") == ErrorCode.SEGMENT_ALREADY_EXISTS
    assert code_of(c.call, Op.PING) == ErrorCode.INVALID_PARAMS
    listed = {s["segment_id"]: s for s in c.call(Op.LIST_SEGMENTS)["segments"]}
    assert listed["s1"]["capacity"] == 1 << 20 and listed["s1"]["state"] == "active"
    got = c.call(Op.GET_SEGMENTS, segment_ids=["s1", "nope"])["segments"]
    assert list(got) == ["s1"] and got["s1"]["endpoint"] == "tcp://127.0.0.1:1"
    assert code_of(c.call, Op.UNMOUNT_SEGMENT, client_id="other", segment_id="s1") \
        == ErrorCode.PERMISSION_DENIED
    c.call(Op.UNMOUNT_SEGMENT, client_id="c1", segment_id="s1")
    assert code_of(c.call, Op.UNMOUNT_SEGMENT, client_id="c1", segment_id="s1") \
        == ErrorCode.SEGMENT_NOT_FOUND
    bad = segment_wire("x", "c1")
    bad["size"] = -5
    assert code_of(c.call, Op.MOUNT_SEGMENT, client_id="c1", segment=bad) \
        == ErrorCode.INVALID_PARAMS
    del bad["kind"]
    assert code_of(c.call, Op.MOUNT_SEGMENT, client_id="c1", segment=bad) \
        == ErrorCode.INVALID_PARAMS
    assert c.call(Op.STATS)["segments"] == 1


def test_put_get_remove_single_ops(mclient: MasterClient) -> None:
    c = mclient
    key = mount(c, "s1")
    assert len(key) == 32
    assert code_of(c.call, Op.PUT_START, client_id="c1", key="k", size=10**9) \
        == ErrorCode.NO_AVAILABLE_HANDLE
    r = c.call(Op.PUT_START, client_id="c1", key="k", size=1000, checksum=1234)
    assert r["replicas"][0][:4] == ["s1", 0, 1000, 0]  # PROCESSING
    assert r["segments"]["s1"]["name"] == "kvpool-s1"
    assert code_of(c.call, Op.GET_REPLICA_LIST, key="k") == ErrorCode.REPLICA_IS_NOT_READY
    assert c.call(Op.EXIST, key="k") == {"exists": False}
    assert code_of(c.call, Op.PUT_START, client_id="c2", key="k", size=10) \
        == ErrorCode.OBJECT_ALREADY_EXISTS
    assert code_of(c.call, Op.PUT_END, client_id="c2", key="k") == ErrorCode.INVALID_WRITE
    c.call(Op.PUT_END, client_id="c1", key="k")
    g = c.call(Op.GET_REPLICA_LIST, key="k")
    assert g["size"] == 1000 and g["checksum"] == 1234 and g["lease_ttl_ms"] == 1000
    assert g["replicas"][0][:4] == ["s1", 0, 1000, 1] and "s1" in g["segments"]
    # issue 7: a READ capability for exactly this replica, signed with s1's key
    assert verify(g["replicas"][0][4], key, "s1", 0, 1000, CapOp.READ).length == 1000
    assert verify(r["replicas"][0][4], key, "s1", 0, 1000, CapOp.WRITE).op == CapOp.WRITE
    with pytest.raises(CapabilityError):
        verify(g["replicas"][0][4], key, "s1", 0, 1000, CapOp.WRITE)
    assert c.call(Op.GET_SIZE, key="k") == {"size": 1000}
    assert code_of(c.call, Op.GET_SIZE, key="zz") == ErrorCode.OBJECT_NOT_FOUND
    # leased by the read above: remove refused unless forced
    assert code_of(c.call, Op.REMOVE, key="k") == ErrorCode.OBJECT_HAS_LEASE
    c.call(Op.REMOVE, key="k", force=True)
    assert code_of(c.call, Op.REMOVE, key="k") == ErrorCode.OBJECT_NOT_FOUND
    # revoke gives the space back once the writer's WRITE capability ended
    # (a late write must not land in the next object placed there): held now
    c.call(Op.PUT_START, client_id="c1", key="r", size=1 << 16)
    c.call(Op.PUT_REVOKE, client_id="c1", key="r")
    assert code_of(c.call, Op.PUT_REVOKE, client_id="c1", key="r") == ErrorCode.OBJECT_NOT_FOUND
    st = c.call(Op.STATS)
    assert st["memory_used"] == 1 << 16 and st["held_puts"] == 1 and st["pending"] == 0
    # lease expires (1 s in this fixture): plain remove works afterwards
    put(c, "l")
    assert c.call(Op.EXIST, key="l") == {"exists": True}
    assert code_of(c.call, Op.REMOVE, key="l") == ErrorCode.OBJECT_HAS_LEASE
    time.sleep(1.1)
    c.call(Op.REMOVE, key="l")
    st = c.call(Op.STATS)
    assert st["lease_refusals"] == 2 and st["objects"] == 0


def test_bad_arguments_rejected(mclient: MasterClient) -> None:
    c = mclient
    mount(c, "s1")
    cases: list[tuple[Op, dict[str, Any], int]] = [
        (Op.PUT_START, {"client_id": "c1", "key": "", "size": 1}, ErrorCode.INVALID_KEY),
        (Op.PUT_START, {"client_id": "c1", "key": "x" * 5000, "size": 1}, ErrorCode.INVALID_KEY),
        (Op.PUT_START, {"client_id": "c1", "key": 5, "size": 1}, ErrorCode.INVALID_KEY),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": -1}, ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": 0}, ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": "1"}, ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": 1, "replica_num": -1},
         ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": 1, "preferred_segments": "s1"},
         ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": 1, "hard_pin": "yes"},
         ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"key": "a", "size": 1}, ErrorCode.INVALID_PARAMS),
        (Op.GET_REPLICA_LIST, {"key": None}, ErrorCode.INVALID_KEY),
        (Op.REMOVE, {"key": "a", "force": 1}, ErrorCode.INVALID_PARAMS),
        (Op.BATCH_EXIST, {"keys": "abc"}, ErrorCode.INVALID_PARAMS),
        (Op.BATCH_EXIST, {"keys": ["k"] * 20000}, ErrorCode.INVALID_PARAMS),
        (Op.BATCH_PUT_START, {"client_id": "c1", "items": {}}, ErrorCode.INVALID_PARAMS),
        (Op.GET_SEGMENTS, {"segment_ids": 3}, ErrorCode.INVALID_PARAMS),
    ]
    for op, args, code in cases:
        assert code_of(c.call, op, **args) == code, (op, args)
    st = c.call(Op.STATS)
    assert st["objects"] == 0 and st["pending"] == 0 and st["memory_used"] == 0


def test_batch_ops(mclient: MasterClient) -> None:
    c = mclient
    mount(c, "m1")
    mount(c, "m2")
    mount(c, "f1", kind=FILE)
    items = [{"key": f"k{i}", "size": 4096 + i, "replica_num": 2} for i in range(50)]
    items.append({"key": "", "size": 1})
    items.append({"key": "k0", "size": 1})  # duplicate within the batch
    items.append({"key": "disk", "size": 10, "replica_num": 1, "disk_replica_num": 1})
    items.append("junk")
    r = c.call(Op.BATCH_PUT_START, client_id="c1", items=items)
    res = r["results"]
    assert [x[0] for x in res[50:]] == [ErrorCode.INVALID_KEY, ErrorCode.OBJECT_ALREADY_EXISTS,
                                        0, ErrorCode.INVALID_PARAMS]
    for code, reps in res[:50]:
        assert code == 0 and len(reps) == 2 and reps[0][0] != reps[1][0]  # distinct segments
    disk = res[52][1]
    assert len(disk) == 2 and disk[1][0] == "f1" and disk[0][0] in ("m1", "m2")
    assert set(r["segments"]) == {"m1", "m2", "f1"}
    keys = [f"k{i}" for i in range(50)] + ["disk", "missing", 7]
    e = c.call(Op.BATCH_PUT_END, client_id="c1", keys=keys)["results"]
    assert [x[0] for x in e] == [0] * 51 + [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_KEY]
    g = c.call(Op.BATCH_GET_REPLICA_LIST, keys=["k3", "missing", "disk"])
    assert g["results"][0][0] == 0 and g["results"][0][1]["size"] == 4099
    assert g["results"][1] == [ErrorCode.OBJECT_NOT_FOUND, None]
    assert [x[0] for x in g["results"][2][1]["replicas"]] == [disk[0][0], "f1"]
    assert all(rep[3] == 1 for rep in g["results"][0][1]["replicas"])
    assert set(g["segments"]) <= {"m1", "m2", "f1"} and g["segments"]
    ex = c.call(Op.BATCH_EXIST, keys=["k1", "nope", ""])["results"]
    assert ex == [[0, True], [0, False], [ErrorCode.INVALID_KEY, None]]
    sz = c.call(Op.BATCH_GET_SIZE, keys=["k9", "nope"])["results"]
    assert sz == [[0, 4105], [ErrorCode.OBJECT_NOT_FOUND, None]]
    rm = c.call(Op.BATCH_REMOVE, keys=["k1", "k2", "nope"])["results"]  # k1 leased by exist
    assert [x[0] for x in rm] == [ErrorCode.OBJECT_HAS_LEASE, 0, ErrorCode.OBJECT_NOT_FOUND]
    rm = c.call(Op.BATCH_REMOVE, keys=["k1"], force=True)["results"]
    assert rm == [[0, None]]
    c.call(Op.BATCH_PUT_START, client_id="c1", items=[{"key": "p1", "size": 5},
                                                      {"key": "p2", "size": 5}])
    rv = c.call(Op.BATCH_PUT_REVOKE, client_id="c1", keys=["p1", "p2", "p3"])["results"]
    assert [x[0] for x in rv] == [0, 0, ErrorCode.OBJECT_NOT_FOUND]
    n = c.call(Op.STATS)["objects"]
    assert n == 49  # 50 + disk - k1 - k2
    # remove_all skips leased objects (k3 and disk read above, k5 now) unless forced
    c.call(Op.EXIST, key="k5")
    assert c.call(Op.REMOVE_ALL)["removed"] == n - 3
    assert c.call(Op.REMOVE_ALL, force=True)["removed"] == 3
    st = c.call(Op.STATS)  # only the two revoked puts' space, held for their writer
    assert st["bytes_used"] == 2 * 64 and st["held_puts"] == 2


def test_req_socket_and_unknown_op(master_proc: MasterProcess) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(f"tcp://{master_proc.address}")
    try:
        s.send(encode_frame({"op": int(Op.PING), "id": 1, "args": {"client_id": "req"}}))
        rep = decode_frame(s.recv())
        assert rep["id"] == 1 and rep["code"] == 0 and rep["result"]["remount"] is True
        s.send(encode_frame({"op": 999, "id": 2, "args": {}}))
        rep = decode_frame(s.recv())
        assert rep == {"id": 2, "code": ErrorCode.UNKNOWN_OP, "result": None,
                       "error": rep["error"]}
        s.send(b"\xc1garbage")
        rep = decode_frame(s.recv())
        assert rep["code"] == ErrorCode.MALFORMED_FRAME
    finally:
        s.close(0)


def test_oversized_frame_rejected(tmp_path: Any) -> None:
    with MasterProcess(extra_args=["--max-frame-size", "100000"]) as m, m.client() as c:
        assert code_of(c.call, Op.BATCH_EXIST, keys=["x" * 1000] * 150) == \
            ErrorCode.FRAME_TOO_LARGE
        # far beyond the limit ZeroMQ drops the connection: the call times out
        # (over the same-host Unix socket the master answers FRAME_TOO_LARGE) ...
        assert code_of(c.call, Op.BATCH_EXIST, timeout_s=1,
                       keys=["x" * 1000] * 300) in (ErrorCode.RPC_TIMEOUT,
                                                    ErrorCode.FRAME_TOO_LARGE)
        with MasterClient(m.address, local="off") as z:
            assert code_of(z.call, Op.BATCH_EXIST, timeout_s=1,
                           keys=["x" * 1000] * 300) == ErrorCode.RPC_TIMEOUT
        # ... and the master keeps serving
        assert c.call(Op.BATCH_EXIST, keys=["a"])["results"] == [[0, False]]


def test_eviction_under_pressure_spares_leased_and_hard_pinned(tmp_path: Any) -> None:
    args = ["--eviction-high-watermark", "0.8", "--eviction-ratio", "0.2"]
    with MasterProcess(lease_ttl_ms=60000, extra_args=args) as m, m.client() as c:
        mount(c, "m1", size=64 * 1024)
        mount(c, "m2", size=64 * 1024)
        protected = []
        for i in range(10):
            put(c, f"pin{i}", 1024, hard_pin=True)
            protected.append(f"pin{i}")
        for i in range(10):
            put(c, f"lease{i}", 1024)
            protected.append(f"lease{i}")
        c.call(Op.BATCH_GET_REPLICA_LIST, keys=[f"lease{i}" for i in range(10)])
        for i in range(500):  # ~4x the pool
            items = [{"key": f"x{i}", "size": 1024, "replica_num": 2}]
            res = c.call(Op.BATCH_PUT_START, client_id="c1", items=items)["results"]
            assert res[0][0] == 0, res
            assert len({rep[0] for rep in res[0][1]}) == len(res[0][1])  # distinct segments
            c.call(Op.BATCH_PUT_END, client_id="c1", keys=[f"x{i}"])
        st = c.call(Op.STATS)
        assert st["evictions"] > 300
        assert st["memory_used"] <= 0.8 * st["memory_capacity"]
        ex = c.call(Op.BATCH_EXIST, keys=protected)["results"]
        assert all(r == [0, True] for r in ex), ex
        assert c.call(Op.EXIST, key="x499")["exists"]


def test_client_expiry_drops_segments_and_objects(tmp_path: Any) -> None:
    with MasterProcess(client_ttl_s=1.0) as m, m.client() as c:
        for i in range(3):
            mount(c, f"dead{i}", client_id="dying")
        mount(c, "live", client_id="alive")
        for i in range(30):
            put(c, f"d{i}", client_id="alive", preferred_segments=[f"dead{i % 3}"])
        put(c, "both", client_id="alive", replica_num=2, preferred_segments=["dead0", "live"])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            c.call(Op.PING, client_id="alive")
            if c.call(Op.STATS)["segments"] == 1:
                break
            time.sleep(0.2)
        st = c.call(Op.STATS)
        assert st["segments"] == 1 and st["expired_clients"] >= 1
        assert st["objects"] == 1
        g = c.call(Op.GET_REPLICA_LIST, key="both")
        assert [r[0] for r in g["replicas"]] == ["live"]
        assert code_of(c.call, Op.GET_REPLICA_LIST, key="d0") == ErrorCode.OBJECT_NOT_FOUND
        # the expired client comes back: it is told to remount
        assert c.call(Op.PING, client_id="dying")["remount"] is True


def test_preferred_segment_and_config_file(tmp_path: Any) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("max_key_length: 8\nmemory_alignment: 4096\nlease_ttl_ms: 1\n")
    with MasterProcess(extra_args=["--config", str(cfg)]) as m, m.client() as c:
        mount(c, "a")
        mount(c, "b")
        r = put(c, "k", 10, preferred_segments=["b"])
        assert r["replicas"][0][0] == "b"
        r = put(c, "k2", 10, preferred_segments=["b"])
        assert r["replicas"][0][1] == 4096  # memory_alignment from the file
        assert code_of(put, c, "123456789") == ErrorCode.INVALID_KEY  # max_key_length: 8
        # flags override the file (MasterProcess passes --lease-ttl-ms 10000)
        assert c.call(Op.GET_REPLICA_LIST, key="k")["lease_ttl_ms"] == 10000
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\n")
    with pytest.raises(KVPoolError, match="no_such_key"):
        MasterProcess(extra_args=["--config", str(bad)]).start()


def test_thousand_clients_expire_at_once_loop_keeps_serving(tmp_path: Any) -> None:
    n = 1000
    with MasterProcess(client_ttl_s=1.0, extra_args=["--snapshot-interval-s", "0"]) as m, \
            m.client() as c:
        for i in range(n):
            mount(c, f"seg{i}", client_id=f"cl{i}", size=1 << 16)
        items = [{"key": f"o{i}", "size": 100, "preferred_segments": [f"seg{i}"]}
                 for i in range(n)]
        res = c.call(Op.BATCH_PUT_START, client_id="writer", items=items)["results"]
        assert [r[1][0][0] for r in res] == [f"seg{i}" for i in range(n)]
        c.call(Op.BATCH_PUT_END, client_id="writer", keys=[f"o{i}" for i in range(n)])
        assert c.call(Op.STATS)["segments"] == n
        # all 1000 owners go silent together; the loop drops them in bounded slices
        # while it keeps answering (every call below has a 2 s timeout)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            st = c.call(Op.STATS, timeout_s=2)
            c.call(Op.PING, client_id="writer", timeout_s=2)
            if st["segments"] == 0 and st["objects"] == 0:
                break
            time.sleep(0.05)
        assert st["segments"] == 0 and st["objects"] == 0
        assert st["expired_clients"] >= n
        assert c.call(Op.BATCH_EXIST, keys=["o0", f"o{n - 1}"])["results"] == [[0, False]] * 2
