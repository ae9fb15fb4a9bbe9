"""Liveness at the master: busy is not dead.

A client silent for ``client_ttl_s`` is suspect (no new placements, objects
kept, read when nothing else holds them), ACTIVE again with every object at
its next ping, and dropped only when it and its guard stay silent for
``client_ttl_s + client_grace_s`` (or it unmounts). Unit tests drive the
Directory with a controllable clock; the rest run a real master process.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    GetReplicaList,
    ListSegments,
    MountSegment,
    Ping,
    PingReply,
    PutEnd,
    PutOptions,
    PutStart,
    PutStartReply,
    SegmentDescriptor,
    Stats,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory, SegState
from kvpool.master.tiering import TieringPolicy
from kvpool.master.tiering_config import TieringConfig
from support.clock import Clock
from support.directory import FILE, MEM, make, mount, put, seg_ids
from support.factories import segment_desc

# ---------------------------------------------------------------------- directory


def test_silent_clients_are_suspect_then_dropped_after_grace_in_slices() -> None:
    d, clock = make(client_ttl_s=10, client_grace_s=50, expiry_slice=3, purge_slice=5)
    for c in range(4):
        for s in range(2):
            mount(d, f"s{c}{s}", 1 << 20, client=f"c{c}")
    mount(d, "keep", 1 << 20, client="alive")
    for i in range(20):
        assert put(d, f"k{i}", 100, client="alive", replica_num=1,
                   preferred=[f"s{i % 4}0"]) == 0
    assert put(d, "both", 100, client="alive", replica_num=2, preferred=["s00", "keep"]) == 0
    cap = d.pool_cap[MEM]
    clock.t += 5
    d.ping("alive")
    clock.t += 6
    # silent past client_ttl: suspect, in bounded slices; nothing is dropped
    assert [d.liveness.expire_step() for _ in range(3)] == [0, 0, 0]
    assert all(d.segments[f"s{c}{s}"].state == SegState.SUSPECT for c in range(4) for s in range(2))
    st = d.stats()
    assert st["suspect_segments"] == 8 and st["suspect_clients"] == 4
    assert st["objects"] == 21 and d.pool_cap[MEM] == cap - 8 * (1 << 20)
    # no new placement on a suspect segment, even when asked for one
    assert put(d, "new", 100, client="alive", preferred=["s00"]) == 0
    assert seg_ids(d, "new") == ["keep"]
    # reads: the active replica only; a suspect one when there is nothing else
    assert [s.id for s in d.get_replicas("both")[1][1][::2]] == ["keep"]
    assert [s.id for s in d.get_replicas("k1")[1][1][::2]] == ["s10"]
    # c1 pings again: ACTIVE with its objects; c2's guard keeps c2 past the grace
    d.ping("c1")
    assert d.segments["s10"].state == SegState.ACTIVE and "k1" in d.segments["s10"].keys
    assert d.stats()["revived_clients"] == 1
    clock.t += 30
    assert d.liveness.heartbeat("c2") and not d.liveness.heartbeat("stranger")
    d.ping("alive")
    clock.t += 20  # c0, c3: 61 s of silence > ttl + grace
    results = []
    while (n := d.liveness.expire_step()) or not results:
        results.append(n)
    assert sum(results) == 4 and max(results) <= 3
    assert set(d.segments) == {"keep", "s10", "s11", "s20", "s21"}
    assert d.segments["s10"].state == SegState.SUSPECT  # c1 went silent again since
    assert d.segments["s20"].state == SegState.SUSPECT
    while d.purge_step(5):
        pass
    assert {f"k{i}" for i in range(20) if i % 4 in (0, 3)}.isdisjoint(d.objects)
    assert {f"k{i}" for i in range(20) if i % 4 in (1, 2)} <= set(d.objects)
    assert seg_ids(d, "both") == ["keep"]
    assert d.clients.keys() == {"alive", "c1", "c2"}


def test_mount_readopts_suspect_segment_only_with_the_same_memory() -> None:
    d, clock = make(client_ttl_s=1, client_grace_s=100)
    mount(d, "a", 1 << 20, client="c1")
    assert put(d, "k", 100, client="c1") == 0
    clock.t += 2
    d.liveness.expire_step()
    assert d.segments["a"].state == SegState.SUSPECT
    mount(d, "a", 1 << 20, client="c1")  # same shm name: same memory, objects kept
    assert d.segments["a"].state == SegState.ACTIVE and d.get_replicas("k")[0] == 0
    clock.t += 2
    d.liveness.expire_step()
    # the same id with another shm name is new memory: the old objects go
    d.mount("c9", SegmentDescriptor("a", "c9", "h", MEM, 1 << 20, "kvpool-a-new"))
    assert d.segments["a"].state == SegState.ACTIVE and d.segments["a"].owner == "c9"
    assert d.get_replicas("k")[0] == ErrorCode.OBJECT_NOT_FOUND
    with pytest.raises(KVPoolError) as ei:  # an active segment is not taken
        d.mount("c1", SegmentDescriptor("a", "c1", "h", MEM, 1 << 20, "kvpool-a"))
    assert ei.value.code == ErrorCode.SEGMENT_ALREADY_EXISTS


def test_guard_heartbeat_after_restart_keeps_segments_suspect() -> None:
    d, _clock = make(client_ttl_s=1, client_grace_s=5)
    mount(d, "a", 1 << 20, client="c1")
    mount(d, "b", 1 << 20, client="c2")
    assert put(d, "ka", 100, client="c1", preferred=["a"]) == 0
    records = list(d.records)
    r, clock2 = make(client_ttl_s=1, client_grace_s=5)
    r.journaling = False
    for rec in records:
        r.apply_record(rec)
    r.finish_restore()
    r.journaling = True
    assert r.liveness.heartbeat("c1")  # c1's process is stalled; its guard answers
    assert r.segments["a"].state == SegState.SUSPECT
    assert [s.id for s in r.get_replicas("ka")[1][1][::2]] == ["a"]
    for _ in range(10):  # 10 s: past the awaiting deadline, the guard keeps beating
        clock2.t += 1
        r.liveness.heartbeat("c1")
        r.liveness.expire_step()
    assert set(r.segments) == {"a"}  # c2 never came back: dropped
    r.ping("c1")
    assert r.segments["a"].state == SegState.ACTIVE and r.stats()["suspect_clients"] == 0


def test_suspect_file_segment_is_kept_by_the_tier_policy_after_the_grace() -> None:
    clock = Clock()
    policy = TieringPolicy(TieringConfig(file_owner_ttl_s=100), clock=clock)
    d = Directory(MasterConfig(client_ttl_s=1, client_grace_s=2), clock=clock, hooks=policy)
    d.mount("node", SegmentDescriptor("disk", "node", "h", FILE, 1 << 20, "/d/seg"))
    code, _ = d.put_start("node", "k", 100, replica_num=0, disk_replica_num=1)
    assert code == 0 and d.put_end("node", "k") == 0
    clock.t += 1.5
    d.liveness.expire_step()
    assert d.segments["disk"].state == SegState.SUSPECT
    clock.t += 2
    d.liveness.expire_step()  # dropped client: the tier policy keeps its disk for a warm restart
    assert d.segments["disk"].state == SegState.AWAITING and "k" in d.objects
    assert "node" not in d.clients


# ---------------------------------------------------------------------- master process


def _mount(c: MasterClient, sid: str, client_id: str) -> None:
    c.call(MountSegment(client_id, segment_desc(sid, client_id)))


def _put(c: MasterClient, key: str, client_id: str = "c1", **kw: Any) -> PutStartReply:
    r = c.call(PutStart(client_id, key, 100, PutOptions(**kw) if kw else None))
    c.call(PutEnd(client_id, key))
    return r


def _holders(c: MasterClient, key: str) -> list[str]:
    return [r.segment_id for r in c.call(GetReplicaList(key)).replicas]


def code_of(fn: Any, *a: Any, **kw: Any) -> int:
    with pytest.raises(MasterRPCError) as ei:
        fn(*a, **kw)
    return int(ei.value.code)


def test_silent_client_is_suspect_then_dropped_after_grace(tmp_path: Any) -> None:
    with MasterProcess(client_ttl_s=1.0, metrics_port=find_free_port(),
                       extra_args=["--client-grace-s", "1.5"]) as m, m.client() as c:
        for i in range(3):
            _mount(c, f"dead{i}", "dying")
        _mount(c, "live", "alive")
        for i in range(30):
            _put(c, f"d{i}", client_id="alive", preferred_segments=[f"dead{i % 3}"])
        _put(c, "both", client_id="alive", replica_num=2, preferred_segments=["dead0", "live"])
        t0 = time.monotonic()

        def states() -> dict[str, str]:
            return {s.descriptor.segment_id: s.state for s in c.call(ListSegments()).segments}

        while states()["dead0"] != "suspect":
            c.call(Ping("alive"))
            assert time.monotonic() - t0 < 5, states()
            time.sleep(0.1)
        # suspect: kept with every object, no new placements, read when nothing else is
        st = c.call(Stats())
        assert st.segments == 4 and st.objects == 31 and st.suspect_segments == 3
        assert st.suspect_clients == 1 and st.suspected_clients == 1 and not st.extra
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}/metrics",
                                         timeout=5).read().decode()
        assert "kvpool_master_suspect_segments 3.0" in metrics
        assert "kvpool_master_suspect_clients 1.0" in metrics
        assert "kvpool_master_suspected_clients_total 1.0" in metrics
        assert states() == {"dead0": "suspect", "dead1": "suspect", "dead2": "suspect",
                            "live": "active"}
        assert [r.segment_id for r in _put(c, "new", client_id="alive",
                                           preferred_segments=["dead1"]).replicas] == ["live"]
        assert _holders(c, "both") == ["live"]
        assert _holders(c, "d1") == ["dead1"]
        # a guard heartbeat is not the client: it keeps the segments, suspect
        assert c.call(Ping("dying", heartbeat=True)) == PingReply(False, known=True)
        assert states()["dead0"] == "suspect"
        # silent (guard too) for ttl + grace: dropped with the objects only there
        deadline = time.monotonic() + 10
        while c.call(Stats()).segments != 1:
            c.call(Ping("alive"))
            assert time.monotonic() < deadline
            time.sleep(0.1)
        st = c.call(Stats())
        assert st.segments == 1 and st.expired_clients >= 1
        assert st.objects == 2 and st.suspect_segments == 0 and st.suspect_clients == 0
        assert _holders(c, "both") == ["live"]
        assert code_of(c.call, GetReplicaList("d0")) == ErrorCode.OBJECT_NOT_FOUND
        # the dropped client comes back: it is told to remount; its guard is not known
        assert c.call(Ping("dying", heartbeat=True)) == PingReply(False, known=False)
        assert c.call(Ping("dying")).remount is True


def test_suspect_client_is_revived_with_its_objects(tmp_path: Any) -> None:
    with MasterProcess(client_ttl_s=0.5) as m, m.client() as c:
        _mount(c, "s", "busy")
        _put(c, "k", client_id="busy")
        deadline = time.monotonic() + 5
        while c.call(Stats()).suspect_segments != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.call(Ping("busy")) == PingReply(False, ["s"])
        st = c.call(Stats())
        assert st.suspect_segments == 0 and st.revived_clients == 1
        assert _holders(c, "k") == ["s"]


def test_status_cli_shows_suspect_segments() -> None:
    with MasterProcess(client_ttl_s=0.5) as m, m.client() as c:
        _mount(c, "quiet-seg", "quiet")
        deadline = time.monotonic() + 5
        while c.call(Stats()).suspect_segments != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "status", "--master",
                              m.address], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if line.startswith("quiet-seg"))
        assert row.split()[4] == "suspect", out.stdout
        assert "segments: 1 (1 suspect)" in out.stdout
