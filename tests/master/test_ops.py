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
from kvpool.core.protocol import (
    BatchExist,
    BatchGetReplicaList,
    BatchGetSize,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchRemove,
    Exist,
    ExistReply,
    GetReplicaList,
    GetSegments,
    GetSize,
    GetSizeReply,
    ListSegments,
    MountSegment,
    Op,
    Ping,
    PingReply,
    PutEnd,
    PutOptions,
    PutRevoke,
    PutStart,
    PutStartReply,
    Remove,
    RemoveAll,
    ReplicaStatus,
    SegmentKind,
    Stats,
    UnmountSegment,
    decode_reply,
    encode_frame,
    encode_request,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from support.factories import segment_desc

MEM = SegmentKind.MEMORY
FILE = SegmentKind.FILE
PROCESSING, COMPLETE = ReplicaStatus.PROCESSING, ReplicaStatus.COMPLETE


def mount(c: MasterClient, sid: str, client_id: str = "c1", size: int = 1 << 20,
          kind: SegmentKind = MEM) -> bytes:
    """Mount; return the segment's capability key from the reply."""
    r = c.call(MountSegment(client_id, segment_desc(sid, client_id, size, kind)))
    return r.capability_key


def put(c: MasterClient, key: str, size: int = 100, client_id: str = "c1",
        **kw: Any) -> PutStartReply:
    r = c.call(PutStart(client_id, key, size, PutOptions(**kw) if kw else None))
    c.call(PutEnd(client_id, key))
    return r


def code_of(fn: Any, *a: Any, **kw: Any) -> int:
    with pytest.raises(MasterRPCError) as ei:
        fn(*a, **kw)
    return int(ei.value.code)


def test_ping_remount_and_segments(mclient: MasterClient) -> None:
    c = mclient
    assert c.call(Ping("c1")) == PingReply(remount=True, segment_ids=[])
    assert c.call(Ping("c1")).remount is False
    mount(c, "s1")
    mount(c, "s2")
    assert c.call(Ping("c1")) == PingReply(remount=False, segment_ids=["s1", "s2"])
    assert code_of(mount, c, "s1") == ErrorCode.SEGMENT_ALREADY_EXISTS
    assert code_of(c.call_raw, Op.PING, []) == ErrorCode.INVALID_PARAMS
    assert code_of(c.call, Ping("")) == ErrorCode.INVALID_PARAMS
    listed = {s.descriptor.segment_id: s for s in c.call(ListSegments()).segments}
    assert listed["s1"].capacity == 1 << 20 and listed["s1"].state == "active"
    got = c.call(GetSegments(["s1", "nope"])).segments
    assert list(got) == ["s1"] and got["s1"].endpoint == "tcp://127.0.0.1:1"
    assert code_of(c.call, UnmountSegment("other", "s1")) == ErrorCode.PERMISSION_DENIED
    c.call(UnmountSegment("c1", "s1"))
    assert code_of(c.call, UnmountSegment("c1", "s1")) == ErrorCode.SEGMENT_NOT_FOUND
    bad = segment_desc("x", "c1")
    bad.size = -5
    assert code_of(c.call, MountSegment("c1", bad)) == ErrorCode.INVALID_PARAMS
    wire = segment_desc("x", "c1").to_wire()
    del wire["kind"]  # a descriptor without its kind (a map, not the array form)
    assert code_of(c.call_raw, Op.MOUNT_SEGMENT, ["c1", wire]) == ErrorCode.INVALID_PARAMS
    assert code_of(c.call_raw, Op.MOUNT_SEGMENT,
                   ["c1", ["x", "c1", "h", 0, 100]]) == ErrorCode.INVALID_PARAMS
    assert c.call(Stats()).segments == 1


def test_put_get_remove_single_ops(mclient: MasterClient) -> None:
    c = mclient
    key = mount(c, "s1")
    assert len(key) == 32
    assert code_of(c.call, PutStart("c1", "k", 10**9)) == ErrorCode.NO_AVAILABLE_HANDLE
    r = c.call(PutStart("c1", "k", 1000, checksum=1234))
    rep = r.replicas[0]
    assert (rep.segment_id, rep.offset, rep.length, rep.status) == ("s1", 0, 1000, PROCESSING)
    assert r.segments["s1"].name == "kvpool-s1"
    assert code_of(c.call, GetReplicaList("k")) == ErrorCode.REPLICA_IS_NOT_READY
    assert c.call(Exist("k")) == ExistReply(exists=False)
    assert code_of(c.call, PutStart("c2", "k", 10)) == ErrorCode.OBJECT_ALREADY_EXISTS
    assert code_of(c.call, PutEnd("c2", "k")) == ErrorCode.INVALID_WRITE
    c.call(PutEnd("c1", "k"))
    g = c.call(GetReplicaList("k"))
    assert g.size == 1000 and g.checksum == 1234 and g.lease_ttl_ms == 1000
    grep = g.replicas[0]
    assert (grep.segment_id, grep.offset, grep.length, grep.status) == ("s1", 0, 1000, COMPLETE)
    assert "s1" in g.segments
    # a READ capability for exactly this replica, signed with s1's key
    assert verify(g.caps[grep.cap], key, "s1", 0, 1000, CapOp.READ).ranges == ((0, 1000),)
    assert verify(r.caps[rep.cap], key, "s1", 0, 1000, CapOp.WRITE).op == CapOp.WRITE
    with pytest.raises(CapabilityError):
        verify(g.caps[grep.cap], key, "s1", 0, 1000, CapOp.WRITE)
    assert c.call(GetSize("k")) == GetSizeReply(size=1000)
    assert code_of(c.call, GetSize("zz")) == ErrorCode.OBJECT_NOT_FOUND
    # leased by the read above: remove refused unless forced
    assert code_of(c.call, Remove("k")) == ErrorCode.OBJECT_HAS_LEASE
    c.call(Remove("k", force=True))
    assert code_of(c.call, Remove("k")) == ErrorCode.OBJECT_NOT_FOUND
    # revoke gives the space back once the writer's WRITE capability ended
    # (a late write must not land in the next object placed there): held now
    c.call(PutStart("c1", "r", 1 << 16))
    c.call(PutRevoke("c1", "r"))
    assert code_of(c.call, PutRevoke("c1", "r")) == ErrorCode.OBJECT_NOT_FOUND
    st = c.call(Stats())
    # and the forced removal of read-leased "k" (1000 bytes, 1 KiB aligned)
    # holds its space until that lease ends
    assert st.memory_used == (1 << 16) + 1024 and st.held_puts == 2 and st.pending == 0
    # lease expires (1 s in this fixture): plain remove works afterwards
    put(c, "l")
    assert c.call(Exist("l")) == ExistReply(exists=True)
    assert code_of(c.call, Remove("l")) == ErrorCode.OBJECT_HAS_LEASE
    time.sleep(1.1)
    c.call(Remove("l"))
    st = c.call(Stats())
    assert st.lease_refusals == 2 and st.objects == 0


def test_no_room_names_the_space_held_for_readers(mclient: MasterClient) -> None:
    """A put that finds no room while a forced removal's space waits for the
    removed object's read lease says so (and how long), and succeeds once
    the lease (1 s here) has ended."""
    c = mclient
    mount(c, "small", size=64 * 1024)
    put(c, "full", 64 * 1024)
    c.call(GetReplicaList("full"))  # a reader's lease
    c.call(Remove("full", force=True))
    with pytest.raises(MasterRPCError) as ei:
        c.call(PutStart("c1", "next", 64 * 1024))
    assert ei.value.code == ErrorCode.NO_AVAILABLE_HANDLE
    assert "65536 bytes of 1 removed or abandoned objects are held" in str(ei.value)
    st = c.call(Stats())  # an operator sees it too (STATS, /metrics, kvpool status)
    assert (st.held_puts, st.held_bytes, st.memory_used) == (1, 64 * 1024, 64 * 1024)
    deadline = time.monotonic() + 5  # the lease's end, then the master's 1 s sweep
    while True:
        try:
            put(c, "next", 64 * 1024)
            break
        except MasterRPCError as exc:
            assert exc.code == ErrorCode.NO_AVAILABLE_HANDLE and time.monotonic() < deadline
            time.sleep(0.1)
    assert (c.call(Stats()).held_puts, c.call(Stats()).held_bytes) == (0, 0)


def test_bad_arguments_rejected(mclient: MasterClient) -> None:
    c = mclient
    mount(c, "s1")
    opts = PutOptions
    cases: list[tuple[Op, list[Any], int]] = [
        (Op.PUT_START, ["c1", "", 1], ErrorCode.INVALID_KEY),
        (Op.PUT_START, ["c1", "x" * 5000, 1], ErrorCode.INVALID_KEY),
        (Op.PUT_START, ["c1", 5, 1], ErrorCode.INVALID_KEY),
        (Op.PUT_START, ["c1", "a", -1], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["c1", "a", 0], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["c1", "a", "1"], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["c1", "a", 1, opts(replica_num=-1)], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["c1", "a", 1, [1, 0, "s1"]], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["c1", "a", 1, [1, 0, [], "yes"]], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, ["a", 1], ErrorCode.INVALID_PARAMS),
        (Op.GET_REPLICA_LIST, [None], ErrorCode.INVALID_KEY),
        (Op.REMOVE, ["a", 1], ErrorCode.INVALID_PARAMS),
        (Op.BATCH_EXIST, ["abc"], ErrorCode.INVALID_KEY),
        (Op.BATCH_EXIST, [["k"] * 20000], ErrorCode.INVALID_PARAMS),
        (Op.BATCH_PUT_START, ["c1", {}, []], ErrorCode.INVALID_KEY),
        (Op.BATCH_PUT_START, ["c1", ["a"], [1, 2]], ErrorCode.INVALID_PARAMS),
        (Op.GET_SEGMENTS, [3], ErrorCode.INVALID_PARAMS),
        (Op.PUT_START, {"client_id": "c1", "key": "a", "size": 1}, ErrorCode.INVALID_PARAMS),
    ]
    for op, args, code in cases:
        assert code_of(c.call_raw, op, args) == code, (op, args)
    st = c.call(Stats())
    assert st.objects == 0 and st.pending == 0 and st.memory_used == 0


def test_batch_ops(mclient: MasterClient) -> None:
    c = mclient
    mount(c, "m1")
    mount(c, "m2")
    mount(c, "f1", kind=FILE)
    keys = [f"k{i}" for i in range(50)] + ["", "k0", "big"]
    sizes = [4096 + i for i in range(50)] + [1, 1, 0]
    r = c.call(BatchPutStart("c1", keys, sizes, PutOptions(replica_num=2)))
    assert r.codes[50:] == [ErrorCode.INVALID_KEY, ErrorCode.OBJECT_ALREADY_EXISTS,
                            ErrorCode.INVALID_PARAMS]  # empty key, duplicate, size 0
    for code, reps in zip(r.codes[:50], r.replicas[:50], strict=True):
        assert code == 0 and len(reps) == 2 and reps[0].segment_id != reps[1].segment_id
    assert r.replicas[50:] == [[], [], []]
    d = c.call(BatchPutStart("c1", ["disk"], [10], PutOptions(replica_num=1,
                                                             disk_replica_num=1)))
    disk = d.replicas[0]
    assert d.codes == [0] and len(disk) == 2
    assert disk[1].segment_id == "f1" and disk[0].segment_id in ("m1", "m2")
    # each reply describes exactly the segments its replicas are on
    assert set(r.segments) == {"m1", "m2"}
    assert set(d.segments) == {disk[0].segment_id, "f1"}
    # one WRITE token per segment for the whole batch covers every replica on it
    assert len(r.caps) == 2 and {rep.cap for reps in r.replicas[:50] for rep in reps} == {0, 1}
    keys = [f"k{i}" for i in range(50)] + ["disk", "missing", ""]
    e = c.call(BatchPutEnd("c1", keys)).codes
    assert e == [0] * 51 + [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_KEY]
    # a key that is not a string fails the call as a whole, as INVALID_KEY
    assert code_of(c.call_raw, Op.BATCH_PUT_END, ["c1", ["k1", 7]]) == ErrorCode.INVALID_KEY
    g = c.call(BatchGetReplicaList(["k3", "missing", "disk"]))
    assert g.codes[0] == 0 and g.sizes[0] == 4099
    assert g.codes[1] == ErrorCode.OBJECT_NOT_FOUND and g.replicas[1] == [] and g.sizes[1] == 0
    assert [x.segment_id for x in g.replicas[2]] == [disk[0].segment_id, "f1"]
    assert all(rep.status == COMPLETE for rep in g.replicas[0])
    assert set(g.segments) <= {"m1", "m2", "f1"} and g.segments
    ex = c.call(BatchExist(["k1", "nope", ""]))
    assert ex.codes == [0, 0, ErrorCode.INVALID_KEY] and ex.exists == [True, False, False]
    sz = c.call(BatchGetSize(["k9", "nope"]))
    assert sz.codes == [0, ErrorCode.OBJECT_NOT_FOUND] and sz.sizes == [4105, 0]
    rm = c.call(BatchRemove(["k1", "k2", "nope"])).codes  # k1 leased by exist
    assert rm == [ErrorCode.OBJECT_HAS_LEASE, 0, ErrorCode.OBJECT_NOT_FOUND]
    rm = c.call(BatchRemove(["k1"], force=True)).codes
    assert rm == [0]
    c.call(BatchPutStart("c1", ["p1", "p2"], [5, 5]))
    rv = c.call(BatchPutRevoke("c1", ["p1", "p2", "p3"])).codes
    assert rv == [0, 0, ErrorCode.OBJECT_NOT_FOUND]
    n = c.call(Stats()).objects
    assert n == 49  # 50 + disk - k1 - k2
    # remove_all skips leased objects (k3 and disk read above, k5 now) unless forced
    c.call(Exist("k5"))
    assert c.call(RemoveAll()).removed == n - 3
    assert c.call(RemoveAll(force=True)).removed == 3
    # held: the two revoked puts' space (for their writer's late writes) and
    # the space of the four read-leased objects removed by force (for their
    # readers' READ grants, until the leases end)
    assert c.call(Stats()).held_puts == 6
    deadline = time.monotonic() + 10
    while (st := c.call(Stats())).held_puts > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st.held_puts == 2 and st.bytes_used == 2 * 64  # the revoked puts' (a longer window)


def test_req_socket_and_unknown_op(master_proc: MasterProcess) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(f"tcp://{master_proc.address}")
    try:
        s.send(encode_request(1, Ping("req")))
        rep = decode_reply(s.recv())
        assert rep.id == 1 and rep.code == 0
        assert msgspec_decode(rep.result, PingReply).remount is True
        s.send(encode_frame([999, 2, []]))
        rep = decode_reply(s.recv())
        assert (rep.id, rep.code) == (2, ErrorCode.UNKNOWN_OP) and rep.error
        s.send(b"\xc1garbage")
        rep = decode_reply(s.recv())
        assert rep.code == ErrorCode.MALFORMED_FRAME and rep.id is None
    finally:
        s.close(0)


def msgspec_decode(raw: Any, tp: Any) -> Any:
    import msgspec

    return msgspec.msgpack.decode(raw, type=tp)


def test_oversized_frame_rejected(tmp_path: Any) -> None:
    with MasterProcess(extra_args=["--max-frame-size", "100000"]) as m, m.client() as c:
        assert code_of(c.call, BatchExist(["x" * 1000] * 150)) == ErrorCode.FRAME_TOO_LARGE
        # far beyond the limit ZeroMQ drops the connection: the call times out
        # (over the same-host Unix socket the master answers FRAME_TOO_LARGE) ...
        assert code_of(c.call, BatchExist(["x" * 1000] * 300), timeout_s=1) in (
            ErrorCode.RPC_TIMEOUT, ErrorCode.FRAME_TOO_LARGE)
        with MasterClient(m.address, local="off") as z:
            assert code_of(z.call, BatchExist(["x" * 1000] * 300), timeout_s=1) \
                == ErrorCode.RPC_TIMEOUT
        # ... and the master keeps serving
        ex = c.call(BatchExist(["a"]))
        assert ex.codes == [0] and ex.exists == [False]


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
        c.call(BatchGetReplicaList([f"lease{i}" for i in range(10)]))
        for i in range(500):  # ~4x the pool
            res = c.call(BatchPutStart("c1", [f"x{i}"], [1024], PutOptions(replica_num=2)))
            assert res.codes[0] == 0, res
            assert len({rep.segment_id for rep in res.replicas[0]}) == len(res.replicas[0])
            c.call(BatchPutEnd("c1", [f"x{i}"]))
        st = c.call(Stats())
        assert st.evictions > 300
        assert st.memory_used <= 0.8 * st.memory_capacity
        ex = c.call(BatchExist(protected))
        assert ex.codes == [0] * 20 and all(ex.exists), ex
        assert c.call(Exist("x499")).exists


def test_preferred_segment_and_config_file(tmp_path: Any) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("max_key_length: 8\nmemory_alignment: 4096\nlease_ttl_ms: 1\n")
    with MasterProcess(extra_args=["--config", str(cfg)]) as m, m.client() as c:
        mount(c, "a")
        mount(c, "b")
        r = put(c, "k", 10, preferred_segments=["b"])
        assert r.replicas[0].segment_id == "b"
        r = put(c, "k2", 10, preferred_segments=["b"])
        assert r.replicas[0].offset == 4096  # memory_alignment from the file
        assert code_of(put, c, "123456789") == ErrorCode.INVALID_KEY  # max_key_length: 8
        # flags override the file (MasterProcess passes --lease-ttl-ms 10000)
        assert c.call(GetReplicaList("k")).lease_ttl_ms == 10000
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\n")
    with pytest.raises(KVPoolError, match="no_such_key"):
        MasterProcess(extra_args=["--config", str(bad)]).start()


def test_thousand_clients_expire_at_once_loop_keeps_serving(tmp_path: Any) -> None:
    n = 1000
    # ttl 3 s: the 1000 mounts and the put must finish before the first owner is silent
    with MasterProcess(client_ttl_s=3.0, extra_args=["--snapshot-interval-s", "0",
                                                      "--client-grace-s", "0"]) as m, \
            m.client() as c:
        for i in range(n):
            mount(c, f"seg{i}", client_id=f"cl{i}", size=1 << 16)
        res = [c.call(BatchPutStart("writer", [f"o{i}"], [100],
                                    PutOptions(preferred_segments=[f"seg{i}"])))
               for i in range(n)]
        assert [r.replicas[0][0].segment_id for r in res] == [f"seg{i}" for i in range(n)]
        c.call(BatchPutEnd("writer", [f"o{i}" for i in range(n)]))
        assert c.call(Stats()).segments == n
        # all 1000 owners go silent together (no grace): the loop marks them suspect
        # and drops them in bounded slices while it keeps answering (2 s timeouts)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            st = c.call(Stats(), timeout_s=2)
            c.call(Ping("writer"), timeout_s=2)
            if st.segments == 0 and st.objects == 0:
                break
            time.sleep(0.05)
        assert st.segments == 0 and st.objects == 0
        assert st.expired_clients >= n
        ex = c.call(BatchExist(["o0", f"o{n - 1}"]))
        assert ex.codes == [0, 0] and ex.exists == [False, False]
