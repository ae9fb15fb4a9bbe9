"""Tenant isolation at the master (docs/tenants.md): every op that names,
lists, counts or removes objects sees only the caller's tenant.

Handler-level (OpHandlers without sockets) for each op, then the wire: a real
master process answering raw requests crafted for another tenant's keys, and
a restart that keeps the stored tenant keys.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.auth import apply_client_curve, load_keypair, load_public_key, save_keypair
from kvpool.core.capability import CapabilitySigner
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.events import TOPIC, EventSubscriber, SegmentAdded, decode_message, topic
from kvpool.core.protocol import (
    BatchExist,
    BatchGetReplicaList,
    BatchGetSize,
    BatchPutCommit,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchRemove,
    BatchReplicaClear,
    BatchUpsertStart,
    CreateCopyTask,
    CreateMoveTask,
    Exist,
    GetReplicaList,
    GetSize,
    ListObjects,
    MountSegment,
    PutCommit,
    PutEnd,
    PutRevoke,
    PutStart,
    QueryTask,
    Remove,
    RemoveAll,
    RemoveByRegex,
    Request,
    Stats,
    UpsertStart,
    decode_reply,
    encode_request,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.master.config import MasterConfig, load_master_config
from kvpool.master.directory import Directory
from kvpool.master.handlers import OpHandlers
from kvpool.master.tiering import TieringPolicy
from support.factories import segment_desc

NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
INVALID_KEY = int(ErrorCode.INVALID_KEY)
TENANTS = ("", "a", "b")  # "" = default


def _handlers() -> OpHandlers:
    cfg = MasterConfig(port=0, lease_ttl_ms=1)  # reads lease for 1 ms: removals go through
    tiering = TieringPolicy(cfg.tiering)
    h = OpHandlers(cfg, Directory(cfg, hooks=tiering), tiering, CapabilitySigner(10_000))
    for seg in ("s1", "s2"):
        h.handle(MountSegment("c1", segment_desc(seg, "c1", 16 << 20)))
    return h


def _put(h: OpHandlers, key: str, size: int, tenant: str = "") -> None:
    h.handle(PutStart("c1", key, size, tenant=tenant))
    h.handle(PutEnd("c1", key, tenant=tenant))


def _code(h: OpHandlers, req: Request[Any]) -> int:
    """The error code of ``req`` run as bytes (0: OK)."""
    return decode_reply(h.handle_payload(encode_request(1, req))).code


def _size(h: OpHandlers, key: str, tenant: str) -> int:
    """``key``'s size in ``tenant`` (0: not there)."""
    try:
        return int(h.handle(GetSize(key, tenant=tenant)).size)  # type: ignore[attr-defined]
    except KVPoolError as exc:
        assert exc.code == ErrorCode.OBJECT_NOT_FOUND
        return 0


@pytest.fixture
def h() -> OpHandlers:
    """Key ``k`` in each tenant: 100 bytes in default, 200 in a, 300 in b."""
    h = _handlers()
    for i, t in enumerate(TENANTS):
        _put(h, "k", 100 * (i + 1), t)
    return h


def test_the_same_key_in_each_tenant_is_its_own_object(h: OpHandlers) -> None:
    for i, t in enumerate(TENANTS):
        assert _size(h, "k", t) == 100 * (i + 1)
        assert h.handle(GetReplicaList("k", tenant=t)).size == 100 * (i + 1)  # type: ignore[attr-defined]
        assert h.handle(Exist("k", tenant=t)).exists  # type: ignore[attr-defined]
        r = h.handle(BatchGetReplicaList(["k", "x"], tenant=t))
        assert r.codes == [0, NOT_FOUND] and r.sizes == [100 * (i + 1), 0]  # type: ignore[attr-defined]
        assert h.handle(BatchGetSize(["k"], tenant=t)).sizes == [100 * (i + 1)]  # type: ignore[attr-defined]
        assert h.handle(BatchExist(["k", "x"], tenant=t)).exists == [True, False]  # type: ignore[attr-defined]
    assert not h.handle(Exist("k", tenant="c")).exists  # type: ignore[attr-defined]
    assert _code(h, GetReplicaList("k", tenant="c")) == NOT_FOUND
    # "default" named is the default tenant
    assert _size(h, "k", "default") == 100
    # a put of a's key is refused as existing in a only
    assert _code(h, PutStart("c1", "k", 5, tenant="a")) == int(ErrorCode.OBJECT_ALREADY_EXISTS)
    h.handle(PutStart("c1", "k", 5, tenant="c"))
    h.handle(PutEnd("c1", "k", tenant="c"))
    assert [_size(h, "k", t) for t in (*TENANTS, "c")] == [100, 200, 300, 5]


def test_no_tenant_can_name_a_stored_key_of_another(h: OpHandlers) -> None:
    stored = "\x1fa\x1fk"  # a's "k" as the master stores it
    for t in TENANTS:
        for req in (GetReplicaList(stored, tenant=t), GetSize(stored, tenant=t),
                    Exist(stored, tenant=t), Remove(stored, True, tenant=t),
                    PutStart("c1", stored, 10, tenant=t), PutEnd("c1", stored, tenant=t),
                    PutRevoke("c1", stored, tenant=t),
                    CreateCopyTask(stored, ["s2"], tenant=t)):
            assert _code(h, req) == INVALID_KEY, (t, req)
        for breq in (BatchGetReplicaList([stored, "k"], tenant=t),
                     BatchExist([stored, "k"], tenant=t), BatchGetSize([stored, "k"], tenant=t),
                     BatchRemove([stored, "\x01"], tenant=t),
                     BatchPutStart("c1", [stored, "new"], [10, 10], tenant=t),
                     BatchPutEnd("c1", [stored], tenant=t),
                     BatchPutRevoke("c1", [stored], tenant=t),
                     BatchReplicaClear("c1", [stored], tenant=t)):
            assert h.handle(breq).codes[0] == INVALID_KEY, (t, breq)  # type: ignore[attr-defined]
    assert _size(h, "k", "a") == 200  # untouched
    # the caller's max key length applies to its key, not to the stored one
    long = "x" * h.cfg.max_key_length
    h.handle(PutStart("c1", long, 10, tenant="a"))
    h.handle(PutEnd("c1", long, tenant="a"))
    assert _size(h, long, "a") == 10
    assert _code(h, Exist(long + "x", tenant="a")) == INVALID_KEY


def test_a_bad_tenant_name_is_invalid_params(h: OpHandlers) -> None:
    for bad in ("a b", "-a", "x" * 65, "a\x1fb", "é"):
        for req in (Exist("k", tenant=bad), BatchExist(["k"], tenant=bad),
                    PutStart("c1", "k2", 10, tenant=bad), RemoveAll(True, tenant=bad),
                    ListObjects(tenant=bad), Stats(tenant=bad), QueryTask(1, tenant=bad)):
            assert _code(h, req) == int(ErrorCode.INVALID_PARAMS), (bad, req)
    assert [_size(h, "k", t) for t in TENANTS] == [100, 200, 300]


def test_writes_commits_revokes_and_reservations_stay_in_their_tenant() -> None:
    h = _handlers()
    r = h.handle(BatchPutStart("c1", ["x", "y"], [10, 20], tenant="a"))
    assert r.codes == [0, 0]  # type: ignore[attr-defined]
    # default's commit of the same names finds no put of its own
    assert h.handle(BatchPutEnd("c1", ["x", "y"])).codes == [NOT_FOUND, NOT_FOUND]  # type: ignore[attr-defined]
    assert h.handle(BatchPutRevoke("c1", ["y"], tenant="b")).codes == [NOT_FOUND]  # type: ignore[attr-defined]
    h.handle(PutRevoke("c1", "y", tenant="a"))
    end = h.handle(BatchPutEnd("c1", ["x"], reserve=30, reserve_count=2, tenant="a"))
    assert end.codes == [0] and len(end.placeholders) == 1  # type: ignore[attr-defined]
    assert [_size(h, "x", t) for t in TENANTS] == [0, 10, 0]
    assert _size(h, "y", "a") == 0
    # a reservation is the client's; the commit names it in the request's tenant
    ph = end.placeholders[0]  # type: ignore[attr-defined]
    again = h.handle(PutCommit("c1", ph, "z", reserve=40, tenant="b"))
    assert [_size(h, "z", t) for t in TENANTS] == [0, 0, 30]
    bc = h.handle(BatchPutCommit("c1", [again.placeholder], ["z"], tenant="a"))  # type: ignore[attr-defined]
    assert bc.codes == [0]  # type: ignore[attr-defined]
    assert [_size(h, "z", t) for t in TENANTS] == [0, 40, 30]
    # upserts replace only the caller's object
    h.handle(UpsertStart("c1", "z", 50, tenant="a"))
    h.handle(PutEnd("c1", "z", tenant="a"))
    up = h.handle(BatchUpsertStart("c1", ["z"], [60], tenant="b"))
    assert up.codes == [0]  # type: ignore[attr-defined]
    h.handle(BatchPutEnd("c1", ["z"], tenant="b"))
    assert [_size(h, "z", t) for t in TENANTS] == [0, 50, 60]
    # a group lives in its tenant: a's group g and b's group g are two
    h.handle(BatchPutStart("c1", ["g1"], [1], groups=["g"], tenant="a"))
    h.handle(BatchPutEnd("c1", ["g1"], tenant="a"))
    h.handle(PutStart("c1", "g1", 1, group="g", tenant="b"))
    h.handle(PutEnd("c1", "g1", tenant="b"))
    assert h.dir.objects.groups == {"\x1fa\x1fg": {"\x1fa\x1fg1"}, "\x1fb\x1fg": {"\x1fb\x1fg1"}}
    # no tenant can name another's group
    for t in TENANTS:
        assert _code(h, PutStart("c1", "g2", 1, group="\x1fa\x1fg", tenant=t)) == \
            int(ErrorCode.INVALID_PARAMS)
        assert _code(h, BatchPutStart("c1", ["g2"], [1], groups=["\x1fa\x1fg"], tenant=t)) \
            == int(ErrorCode.INVALID_PARAMS)
    assert h.dir.objects.groups["\x1fa\x1fg"] == {"\x1fa\x1fg1"}


def test_removal_sees_only_the_callers_tenant(h: OpHandlers) -> None:
    for t in TENANTS:
        for key in ("k2", "keep", "other"):
            _put(h, key, 10, t)
    h.handle(Remove("k", True, tenant="a"))
    assert [_size(h, "k", t) for t in TENANTS] == [100, 0, 300]
    assert h.handle(BatchRemove(["k", "k2"], True, tenant="b")).codes == [0, 0]  # type: ignore[attr-defined]
    assert [_size(h, "k2", t) for t in TENANTS] == [10, 10, 0]
    assert h.handle(BatchReplicaClear("c1", ["k2"], tenant="a")).codes == [0]  # type: ignore[attr-defined]
    assert [_size(h, "k2", t) for t in TENANTS] == [10, 0, 0]
    # regex: pattern, prefix and exclude_prefix over the caller's keys
    removed = h.handle(RemoveByRegex("^o", True, tenant="a")).removed  # type: ignore[attr-defined]
    assert removed == 1 and [_size(h, "other", t) for t in TENANTS] == [10, 0, 10]
    assert h.handle(RemoveByRegex("", True, prefix="k", exclude_prefix="kee")).removed == 2  # type: ignore[attr-defined]
    assert [_size(h, "k", t) for t in TENANTS] == [0, 0, 0]
    assert [_size(h, "k2", t) for t in TENANTS] == [0, 0, 0]
    assert [_size(h, "keep", t) for t in TENANTS] == [10, 10, 10]
    # default's remove_all leaves every tenant's objects; a tenant's leaves the others'
    n = len(h.dir.objects)
    assert h.handle(RemoveAll(True)).removed == 2  # type: ignore[attr-defined]
    assert len(h.dir.objects) == n - 2
    assert [_size(h, "keep", t) for t in TENANTS] == [0, 10, 10]
    assert h.handle(RemoveAll(True, tenant="b")).removed == 2  # keep, other
    assert [_size(h, "keep", t) for t in TENANTS] == [0, 10, 0]
    assert [k for k, _o in h.dir.objects.items()] == ["\x1fa\x1fkeep"]


def test_listing_and_stats_show_only_the_callers_tenant(h: OpHandlers) -> None:
    _put(h, "p1", 1000, "a")
    _put(h, "p2", 10, "b")

    def listed(t: str, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        cursor = 0
        while True:
            r: Any = h.handle(ListObjects(cursor, 3, prefix, tenant=t))
            out.update((o.key, o.size) for o in r.objects)
            assert {s.segment for s in r.segments} == ({"s1", "s2"} if cursor == 0 else set())
            cursor = r.next_cursor
            if not cursor:
                return out

    assert listed("") == {"k": 100}
    assert listed("a") == {"k": 200, "p1": 1000}
    assert listed("b") == {"k": 300, "p2": 10}
    assert listed("a", "p") == {"p1": 1000}
    assert listed("c") == {}
    whole: Any = h.handle(Stats())
    a: Any = h.handle(Stats(tenant="a"))
    assert whole.objects == 5 and a.objects == 2
    assert a.memory_used == 1200 and a.bytes_used == 1200 and a.file_used == 0
    assert a.memory_capacity == whole.memory_capacity == 32 << 20
    assert a.extra == {} and a.tiering == {} and a.evictions == 0
    assert h.handle(Stats(tenant="c")).objects == 0  # type: ignore[attr-defined]


def test_tasks_are_created_and_answered_in_their_tenant(h: OpHandlers) -> None:
    task = h.handle(CreateCopyTask("k", ["s2"], tenant="a")).task_id  # type: ignore[attr-defined]
    job = h.tiering.jobs[task]
    assert job.key == "\x1fa\x1fk"
    q: Any = h.handle(QueryTask(task, tenant="a"))
    assert q.key == "k" and q.task_id == task
    for t in ("", "b"):
        assert _code(h, QueryTask(task, tenant=t)) == int(ErrorCode.TASK_NOT_FOUND)
    assert _code(h, CreateMoveTask("nothing", "s1", "s2", tenant="b")) == NOT_FOUND
    mv = h.handle(CreateMoveTask("k", "s1", "s2")).task_id  # type: ignore[attr-defined]
    assert h.handle(QueryTask(mv)).key == "k"  # type: ignore[attr-defined]
    assert _code(h, QueryTask(mv, tenant="a")) == int(ErrorCode.TASK_NOT_FOUND)


# ============================================================ the wire
def test_raw_requests_for_another_tenants_keys_get_refusals_and_restart_keeps_them(
        tmp_path: Path) -> None:
    """A client crafting raw requests (any tenant field, any key spelling) never
    gets another tenant's replicas; tenant keys survive a snapshot, the journal
    after it and a SIGKILL restart."""
    with MasterProcess(data_dir=str(tmp_path / "d"), lease_ttl_ms=1) as m:
        with m.client() as c:
            c.call(MountSegment("c1", segment_desc("s1", "c1", 16 << 20)))
            c.call(PutStart("c1", "secret", 123, tenant="a"))
            c.call(PutEnd("c1", "secret", tenant="a"))
            os.kill(m.pid, signal.SIGUSR1)  # snapshot it
            deadline = time.monotonic() + 10
            while c.call(Stats()).snapshots < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.call(Stats()).snapshots >= 1
            c.call(BatchPutStart("c1", ["later", "secret"], [7, 8], tenant="b"))  # journaled
            c.call(BatchPutEnd("c1", ["later", "secret"], tenant="b"))
            _refusals(c)
        m.restart(kill=True)
        with m.client() as c:
            assert c.call(GetSize("secret", tenant="a")).size == 123
            assert c.call(BatchGetSize(["later", "secret"], tenant="b")).sizes == [7, 8]
            _refusals(c)
            assert c.call(RemoveAll(True)).removed == 0  # default's remove_all: none of theirs
            assert c.call(BatchExist(["secret"], tenant="a")).exists == [True]


def _refusals(c: MasterClient) -> None:
    """Default, tenant c and spelled-out stored keys get no replica of a's "secret"."""
    for tenant, key in (("", "secret"), ("c", "secret"), ("", "\x1fa\x1fsecret"),
                        ("c", "\x1fa\x1fsecret"), ("b", "\x1fa\x1fsecret")):
        with pytest.raises(MasterRPCError) as ei:
            c.call(GetReplicaList(key, tenant=tenant))
        assert ei.value.code in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_KEY)
        r = c.call(BatchGetReplicaList([key], tenant=tenant))
        assert r.codes[0] in (NOT_FOUND, INVALID_KEY) and r.replicas == [[]]
        assert not c.call(BatchExist([key], tenant=tenant)).exists[0]
    with pytest.raises(MasterRPCError) as ei:
        c.call(Exist("x", tenant="bad tenant"))
    assert ei.value.code == ErrorCode.INVALID_PARAMS
    assert not c.call(ListObjects()).objects and not c.call(ListObjects(tenant="c")).objects
    assert [o.key for o in c.call(ListObjects(tenant="a")).objects] == ["secret"]
    assert c.call(Stats(tenant="c")).objects == 0
    assert c.call(Stats(tenant="a")).objects == 1


def test_each_tenant_follows_its_own_events(tmp_path: Path) -> None:
    """A subscriber of tenant a sees a's objects only, keys as a names them,
    gap-free on its own seq, with every segment; the default topic (existing
    subscribers) carries no tenant's object."""
    port = find_free_port()
    with MasterProcess(extra_args=["--events-port", str(port)]) as m, m.client() as c:
        c.call(MountSegment("c1", segment_desc("s1", "c1", 16 << 20)))
        _wire_put(c, ["k", "only-a"], "a")
        _wire_put(c, ["k"], "b")
        _wire_put(c, ["k"], "")
        raw = zmq.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{port}")
        raw.setsockopt(zmq.SUBSCRIBE, TOPIC)
        ep = f"tcp://127.0.0.1:{port}"
        try:
            with EventSubscriber(ep, c, tenant="a") as sa, EventSubscriber(ep, c, tenant="b") as sb:
                sa.sync()
                sb.sync()
                assert set(sa.view.objects) == {"k", "only-a"}
                assert sa.view.objects["k"].size == 100
                assert set(sb.view.objects) == {"k"}
                _wire_put(c, ["new-a", "k2"], "a")
                _wire_put(c, ["new-default"], "")
                c.call(Remove("k", True, tenant="a"))
                c.call(MountSegment("c1", segment_desc("s2", "c1", 1 << 20)))
                got: list[Any] = []
                deadline = time.monotonic() + 10
                while "s2" not in sa.view.segments or "s2" not in sb.view.segments:
                    assert time.monotonic() < deadline, got
                    got += sa.poll(0.2)
                    sb.poll(0.2)
                assert {getattr(e, "key", None) for e in got} >= {"new-a", "k2", "k"}
                assert set(sa.view.objects) == {"only-a", "new-a", "k2"}
                assert set(sb.view.objects) == {"k"}  # b heard nothing of a's or default's
                assert sa.resyncs == sb.resyncs == 1  # each topic's seq had no gap
                listed = c.call(ListObjects(tenant="a"))
                assert {o.key for o in listed.objects} == set(sa.view.objects)
            # the default topic: default's objects and segments only
            seen: list[Any] = []
            while raw.poll(1500):
                batch = decode_message(raw.recv())
                seen += batch.events
                if any(isinstance(e, SegmentAdded) and e.segment == "s2" for e in seen):
                    break
            keys = {e.key for e in seen if hasattr(e, "key")}
            assert keys == {"new-default"}, seen
        finally:
            raw.close(0)


def _wire_put(c: MasterClient, keys: list[str], tenant: str) -> None:
    r = c.call(BatchPutStart("c1", keys, [100 if tenant == "a" else 50] * len(keys),
                             tenant=tenant))
    assert not any(r.codes)
    assert not any(c.call(BatchPutEnd("c1", keys, tenant=tenant)).codes)


# ============================================================ identity (tenant_keys)
def test_tenant_keys_bind_tenants_to_curve_keys(tmp_path: Path) -> None:
    """With tenant_keys, a connection acts as a tenant only when its CURVE key
    is listed for it (PERMISSION_DENIED otherwise); any key acts as default."""
    keys = tmp_path / "keys"
    cluster_pub, cluster_sec = save_keypair(keys, "cluster")
    _, bob_sec = save_keypair(keys, "bob")
    bob = load_keypair(bob_sec)
    cfg = tmp_path / "master.yaml"
    cfg.write_text(f"tenant_keys:\n  a: [{cluster_pub}]\n  b: ['{bob.public.decode()}']\n")
    with MasterProcess(curve_key=str(cluster_sec),
                       extra_args=["--config", str(cfg), "--curve-allow-dir", str(keys)]) as m, \
            m.client() as alice, \
            MasterClient(m.address, timeout_s=5, curve_server_key=load_public_key(cluster_pub),
                         curve_keypair=(bob.public, bob.secret)) as bobc:
        alice.call(MountSegment("c1", segment_desc("s1", "c1", 1 << 20)))
        _wire_put(alice, ["k"], "a")
        _wire_put(bobc, ["k"], "b")
        _wire_put(bobc, ["k"], "")
        assert alice.call(GetSize("k", tenant="a")).size == 100
        assert bobc.call(GetSize("k", tenant="b")).size == 50
        for c, tenant in ((alice, "b"), (bobc, "a"), (alice, "c"), (bobc, "c")):
            for req in (GetReplicaList("k", tenant=tenant), ListObjects(tenant=tenant),
                        BatchPutStart("c1", ["x"], [1], tenant=tenant),
                        RemoveAll(True, tenant=tenant), Stats(tenant=tenant)):
                with pytest.raises(MasterRPCError) as ei:
                    c.call(req)
                assert ei.value.code == ErrorCode.PERMISSION_DENIED, (tenant, req)
        for c in (alice, bobc):  # anyone may act as default
            assert c.call(GetSize("k")).size == 50
        assert alice.call(GetSize("k", tenant="default")).size == 50
        assert bobc.call(BatchExist(["k"], tenant="b")).exists == [True]
        assert alice.call(Stats()).objects == 3


def test_event_subscriptions_follow_tenant_keys(tmp_path: Path) -> None:
    """With tenant_keys, a subscription to a tenant's topic takes effect only
    for a key listed for that tenant; every-topic prefixes (b"", b"\\x1f")
    never do; the default topic is anyone's."""
    keys = tmp_path / "keys"
    cluster_pub, cluster_sec = save_keypair(keys, "cluster")
    _, bob_sec = save_keypair(keys, "bob")
    alice, bob = load_keypair(cluster_sec), load_keypair(bob_sec)
    cfg = tmp_path / "master.yaml"
    cfg.write_text(f"tenant_keys:\n  a: [{cluster_pub}]\n  b: ['{bob.public.decode()}']\n")
    port = find_free_port()
    server = load_public_key(cluster_pub)
    ctx = zmq.Context.instance()
    subs: dict[str, zmq.Socket[Any]] = {}

    def sub(name: str, pair: Any, *prefixes: bytes) -> None:
        s = subs[name] = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        apply_client_curve(s, server, pair)
        s.connect(f"tcp://127.0.0.1:{port}")
        for p in prefixes:
            s.setsockopt(zmq.SUBSCRIBE, p)

    def keys_heard(name: str, until: str, timeout_s: float = 10.0) -> set[str]:
        """The object keys ``subs[name]`` hears until the segment ``until`` is announced."""
        got: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if subs[name].poll(200):
                events = decode_message(subs[name].recv()).events
                got |= {e.key for e in events if hasattr(e, "key")}
                if any(isinstance(e, SegmentAdded) and e.segment == until for e in events):
                    return got
        raise AssertionError(f"{name} never heard segment {until} (heard {got})")

    with MasterProcess(curve_key=str(cluster_sec),
                       extra_args=["--config", str(cfg), "--curve-allow-dir", str(keys),
                                   "--events-port", str(port)]) as m, \
            m.client() as ac, \
            MasterClient(m.address, timeout_s=5, curve_server_key=server,
                         curve_keypair=(bob.public, bob.secret)) as bc:
        ac.call(MountSegment("c1", segment_desc("s1", "c1", 16 << 20)))
        try:
            sub("alice-a", alice, topic("a"))
            sub("bob-b", bob, topic("b"))
            sub("bob-default", bob, TOPIC)
            sub("bob-prying", bob, topic("a"), b"", b"\x1f", b"\x1fa")
            time.sleep(1.0)  # the subscriptions reach the master
            _wire_put(ac, ["a-key"], "a")
            _wire_put(bc, ["b-key"], "b")
            _wire_put(bc, ["d-key"], "")
            ac.call(MountSegment("c1", segment_desc("s2", "c1", 1 << 20)))
            assert keys_heard("alice-a", "s2") == {"a-key"}
            assert keys_heard("bob-b", "s2") == {"b-key"}
            assert keys_heard("bob-default", "s2") == {"d-key"}
            assert not subs["bob-prying"].poll(1500), \
                decode_message(subs["bob-prying"].recv()).events
        finally:
            for s in subs.values():
                s.close(0)


def test_tenant_keys_need_curve_and_valid_entries(tmp_path: Path) -> None:
    _pub, sec = save_keypair(tmp_path, "k")
    good = load_keypair(sec).public.decode()
    for bad, what in (({"a": [good]}, "needs CURVE"),):
        with pytest.raises(ConfigError, match=what):
            load_master_config(overrides={"tenant_keys": bad})
    curve = {"enabled": True, "secret_key_file": str(sec)}
    for bad, what in (({"a b": [good]}, "invalid tenant name"), ({"a": []}, "non-empty"),
                      ({"a": ["nope"]}, "neither")):
        with pytest.raises(ConfigError, match=what):
            load_master_config(overrides={"tenant_keys": bad, "curve": curve})
    cfg = load_master_config(overrides={"tenant_keys": {"a": [good, str(_pub)]},
                                        "curve": curve})
    assert cfg.tenant_key_sets() == {"a": frozenset({good})}
    # handler level: the connection's key (info.peer) decides
    h = OpHandlers(cfg, Directory(cfg), TieringPolicy(cfg.tiering), None)
    assert _code(h, Exist("k", tenant="a")) == int(ErrorCode.PERMISSION_DENIED)
    assert _code(h, Exist("k")) == 0
    h.info.peer = good
    assert _code(h, Exist("k", tenant="a")) == 0
    assert _code(h, Exist("k", tenant="b")) == int(ErrorCode.PERMISSION_DENIED)

