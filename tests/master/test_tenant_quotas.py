"""Tenant quotas at the master's op handlers (no sockets; docs/tenants.md).

Requests carry the ``tenant`` field as a client sends it; the master scopes
keys, counts usage, evicts a tenant's own least recently used objects at its
quota and refuses with QUOTA_EXCEEDED when none can go. Time is a hand-driven
clock (read leases end when the test says so)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    BatchExist,
    BatchGetReplicaList,
    BatchPutCommit,
    BatchPutEnd,
    BatchPutRevoke,
    BatchPutStart,
    BatchRemove,
    BatchUpsertStart,
    MountSegment,
    PutCommit,
    PutEnd,
    PutOptions,
    PutRevoke,
    PutStart,
    SegmentDescriptor,
    SegmentKind,
    TenantList,
    TenantSet,
)
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.handlers import OpHandlers
from kvpool.master.records import SetQuota
from kvpool.master.tiering import TieringPolicy
from support.clock import Clock

pytestmark = pytest.mark.timeout(30)

SIZE = 4096
QUOTA = int(ErrorCode.QUOTA_EXCEEDED)


class Master:
    """Op handlers over a directory on a hand-driven clock, one memory segment."""

    def __init__(self, segment: int = 1 << 20, **cfg: Any) -> None:
        self.clock = Clock()
        self.cfg = MasterConfig(capabilities=False, **cfg)
        self.cfg.validate()
        tiering = TieringPolicy(self.cfg.tiering)
        self.d = Directory(self.cfg, clock=self.clock, hooks=tiering)
        self.h = OpHandlers(self.cfg, self.d, tiering, None)
        self.h.handle(MountSegment("c1", SegmentDescriptor("s1", "c1", "h", SegmentKind.MEMORY,
                                                           segment, "kvpool-s1")))

    def put(self, tenant: str, *keys: str, size: int = SIZE,
            options: PutOptions | None = None) -> list[int]:
        r = self.h.handle(BatchPutStart("c1", list(keys), [size] * len(keys),
                                        options or PutOptions(), tenant=tenant))
        ok = [k for k, c in zip(keys, r.codes, strict=True) if not c]
        if ok:
            self.h.handle(BatchPutEnd(client_id="c1", keys=ok, tenant=tenant))
        return list(r.codes)

    def exists(self, tenant: str, *keys: str) -> list[bool]:
        return list(self.h.handle(BatchExist(list(keys), tenant=tenant)).exists)

    def read(self, tenant: str, *keys: str) -> list[int]:
        return list(self.h.handle(BatchGetReplicaList(list(keys), tenant=tenant)).codes)

    def row(self, name: str) -> Any:
        return next(r for r in self.h.handle(TenantList()).tenants if r.name == name)

    def leases_end(self) -> None:
        self.clock.t += self.cfg.lease_ttl_ms / 1000 + 1


def test_quota_evicts_the_tenants_own_lru_and_leaves_other_tenants_alone() -> None:
    m = Master(tenants={"a": {"memory": 3 * SIZE}})
    assert m.put("a", "k0", "k1", "k2") == [0, 0, 0]
    assert m.put("b", "k0", "k1", "k2") == [0, 0, 0]  # the same keys: other objects
    assert m.put("", "k0") == [0]
    m.leases_end()
    assert m.read("a", "k0") == [0]  # k0 is now a's most recent
    m.leases_end()
    assert m.put("a", "k3") == [0]  # at its quota: a's least recent (k1) goes
    assert m.exists("a", "k0", "k1", "k2", "k3") == [True, False, True, True]
    # nobody else's object went: readable by replica lists
    assert m.read("b", "k0", "k1", "k2") == [0, 0, 0]
    assert m.read("", "k0") == [0]
    a, b = m.row("a"), m.row("b")
    assert (a.memory_used, a.objects, a.evictions, a.refusals) == (3 * SIZE, 3, 1, 0)
    assert (b.memory_used, b.objects, b.evictions) == (3 * SIZE, 3, 0)
    assert a.memory_quota == 3 * SIZE and b.memory_quota == -1
    assert a.hits >= 1 and a.misses == 1  # the exist of k1


def test_nothing_evictable_is_quota_exceeded_and_changes_nothing() -> None:
    m = Master(tenants={"a": {"memory": 2 * SIZE}})
    assert m.put("a", "k0", "k1") == [0, 0]
    assert m.put("b", "x") == [0]
    assert m.read("a", "k0", "k1") == [0, 0]  # both read-leased: neither may go
    before = (len(m.d.objects), dict(m.d.pool_used), len(m.d.pending), m.row("a").memory_used)
    m.d.records.clear()
    assert m.put("a", "k2", "k3") == [QUOTA, QUOTA]
    assert m.put("a", "huge", size=3 * SIZE) == [QUOTA]  # more than the whole quota
    assert (len(m.d.objects), dict(m.d.pool_used), len(m.d.pending),
            m.row("a").memory_used) == before
    assert m.d.records == []  # nothing journaled
    assert m.exists("a", "k0", "k1", "k2") == [True, True, False]
    assert m.row("a").refusals == 3 and m.row("a").evictions == 0
    # another tenant is not limited by a's quota
    assert m.put("b", "y", "z") == [0, 0]
    m.leases_end()
    assert m.put("a", "k2") == [0]  # leases over: a's LRU (k0) makes room
    assert m.exists("a", "k0", "k1", "k2") == [False, True, True]


def test_disk_quota_evicts_the_tenants_own_disk_replicas() -> None:
    m = Master(tenants={"a": {"disk": 2 * SIZE}})
    m.h.handle(MountSegment("c1", SegmentDescriptor("f1", "c1", "h", SegmentKind.FILE,
                                                    1 << 20, "/nonexistent/f1")))
    both = PutOptions(replica_num=1, disk_replica_num=1)
    assert m.put("a", "k0", "k1", options=both) == [0, 0]
    assert m.put("b", "k0", options=both) == [0]
    a = m.row("a")
    assert (a.memory_used, a.disk_used) == (2 * SIZE, 2 * SIZE)
    m.leases_end()
    assert m.put("a", "k2", options=both) == [0]  # k0's disk replica goes, not b's
    assert m.exists("a", "k0", "k1", "k2") == [True, True, True]  # k0 kept its memory one
    a = m.row("a")
    assert (a.memory_used, a.disk_used, a.evictions) == (3 * SIZE, 2 * SIZE, 1)
    assert m.row("b").disk_used == SIZE
    # a put needing more disk than the whole quota: refused, nothing changes
    assert m.put("a", "big", size=3 * SIZE, options=both) == [QUOTA]
    assert m.row("a").disk_used == 2 * SIZE and m.row("a").refusals == 1


def test_pool_pressure_takes_tenants_above_their_guaranteed_share_first() -> None:
    # 16 objects fill the segment; eviction starts above 90 %
    m = Master(segment=16 * SIZE, tenants={"a": {"guaranteed": 4 * SIZE}, "b": {}})
    assert m.put("a", "a0", "a1", "a2", "a3") == [0] * 4  # the oldest: LRU would take a0
    assert m.put("b", "b0", "b1", "b2", "b3") == [0] * 4
    assert m.put("", *(f"d{i}" for i in range(6))) == [0] * 6
    m.leases_end()
    assert m.put("", "d6") == [0]  # above the watermark: eviction
    assert m.d.evictor.evictions >= 1
    # a holds no more than its guaranteed share: b (no share) went first
    assert m.exists("a", "a0", "a1", "a2", "a3") == [True] * 4
    assert m.exists("b", "b0") == [False]
    assert m.row("b").evictions >= 1 and m.row("a").evictions == 0


def test_pool_pressure_without_guarantees_is_plain_lru() -> None:
    m = Master(segment=16 * SIZE, tenants={"a": {}, "b": {}})
    assert m.put("a", "a0", "a1", "a2", "a3") == [0] * 4
    assert m.put("b", "b0", "b1", "b2", "b3") == [0] * 4
    assert m.put("", *(f"d{i}" for i in range(6))) == [0] * 6
    m.leases_end()
    assert m.put("", "d6") == [0]
    assert m.exists("a", "a0") == [False]  # the control: a's oldest went


def test_tenant_set_is_live_journaled_and_validated() -> None:
    m = Master()
    assert m.put("b", "k0", "k1", "k2", "k3") == [0] * 4
    m.leases_end()
    assert m.read("b", "k0") == [0]  # b has no quota yet: its use order comes from the stamps
    m.d.records.clear()
    reply = m.h.handle(TenantSet("b", memory=2 * SIZE))
    assert [r.name for r in reply.tenants] == ["b"]
    assert reply.tenants[0].memory_quota == 2 * SIZE
    assert reply.tenants[0].memory_used == 4 * SIZE  # lowered below use: nothing evicted yet
    assert m.d.records == [SetQuota("b", 2 * SIZE, -1, -1)]
    m.leases_end()
    assert m.put("b", "k4") == [0]  # evicts b's own LRU down to the new quota
    assert m.exists("b", "k0", "k1", "k2", "k3", "k4") == [True, False, False, False, True]
    assert m.row("b").memory_used == 2 * SIZE
    m.h.handle(TenantSet("b"))  # unlimited again
    assert m.put("b", "k5", "k6") == [0, 0]
    for bad in (TenantSet("-bad"), TenantSet("b", memory=-2), TenantSet("x" * 65)):
        with pytest.raises(KVPoolError) as ei:
            m.h.handle(bad)
        assert ei.value.code == ErrorCode.INVALID_PARAMS
    # a tenant seen only by its keys has the default_tenant_quota
    m2 = Master(default_tenant_quota={"memory": SIZE})
    assert m2.put("new", "k0", "k1") == [0, QUOTA]
    assert m2.row("new").memory_quota == SIZE


def test_usage_is_rebuilt_from_the_objects_on_restore() -> None:
    m = Master(tenants={"a": {"memory": 8 * SIZE}})
    assert m.put("a", "k0", "k1", "k2") == [0, 0, 0]
    assert m.put("a", "gone") == [0]
    m.h.handle(TenantSet("z", memory=SIZE, disk=2 * SIZE))
    m.leases_end()
    m.h.handle(BatchRemove(["gone"], tenant="a"))
    fresh = Directory(m.cfg, clock=m.clock)
    fresh.journaling = False
    assert fresh.apply_records(list(m.d.records)) == []
    fresh.finish_restore()
    rows = {r["name"]: r for r in fresh.tenants.rows(len(fresh.objects))}
    assert (rows["a"]["memory_used"], rows["a"]["objects"]) == (3 * SIZE, 3)
    assert (rows["z"]["memory_quota"], rows["z"]["disk_quota"]) == (SIZE, 2 * SIZE)


def test_quota_counts_object_bytes_not_aligned_space() -> None:
    # 4000-byte objects take 4032 bytes of the segment (64-byte alignment): a
    # put needing 4010 of them must evict two, though one frees 4032 of space
    m = Master(tenants={"a": {"memory": 8000}})
    assert m.put("a", "k0", "k1", size=4000) == [0, 0]
    m.leases_end()
    assert m.put("a", "k2", size=4010) == [0]  # 8000 + 4010 - 8000: both must go
    assert m.exists("a", "k0", "k1", "k2") == [False, False, True]
    assert m.row("a").memory_used == 4010


def test_upsert_at_the_quota_counts_the_replaced_object_as_free() -> None:
    m = Master(tenants={"a": {"memory": 2 * SIZE}})
    assert m.put("a", "k0", "k1") == [0, 0]
    m.leases_end()
    assert m.read("a", "k1") == [0]  # k0 is a's least recent, k1 read-leased
    # upserting k1 at the full quota: k1's own bytes go at the commit, nothing else need go
    r = m.h.handle(BatchUpsertStart("c1", ["k1"], [SIZE], tenant="a"))
    assert list(r.codes) == [0]
    assert m.exists("a", "k0") == [True]
    m.h.handle(BatchPutEnd(client_id="c1", keys=["k1"], tenant="a"))
    assert m.row("a").memory_used == 2 * SIZE and m.row("a").objects == 2
    # a bigger upsert of k0 needs room beyond k0's own bytes: k1 (the new one,
    # read) is leased, so refused
    assert m.read("a", "k1") == [0]
    r = m.h.handle(BatchUpsertStart("c1", ["k0"], [2 * SIZE], tenant="a"))
    assert list(r.codes) == [QUOTA]
    assert m.exists("a", "k0", "k1") == [True, True]


def test_a_batch_crossing_the_quota_stops_at_it() -> None:
    m = Master(tenants={"a": {"memory": 3 * SIZE}})
    # the puts in flight of the batch itself count: nothing complete to evict
    assert m.put("a", *(f"k{i}" for i in range(5))) == [0, 0, 0, QUOTA, QUOTA]
    a = m.row("a")
    assert (a.memory_used, a.objects, a.refusals) == (3 * SIZE, 3, 2)
    m.leases_end()
    # the next batch evicts the oldest of the last as it goes
    assert m.put("a", "n0", "n1") == [0, 0]
    assert m.exists("a", "k0", "k1", "k2", "n0", "n1") == [False, False, True, True, True]
    assert m.row("a").memory_used == 3 * SIZE


def _state(m: Master) -> tuple[Any, ...]:
    """What a refused commit must leave as it was (the reservation aside)."""
    rows = [(r.memory_used, r.objects, r.evictions) for r in m.h.handle(TenantList()).tenants]
    return len(m.d.objects), sorted(m.d.objects), dict(m.d.pool_used), rows


def test_put_commit_of_a_reservation_is_held_to_the_quota() -> None:
    """A spare allocation (PUT_END's reservation) named by PUT_COMMIT is
    admitted as a put start is: the tenant's own LRU objects make room, else
    QUOTA_EXCEEDED, nothing changes and the reservation is released."""
    m = Master(tenants={"a": {"memory": 2 * SIZE}})
    h = m.h.handle
    assert m.put("b", "k0") == [0]  # another tenant's: never a victim
    h(PutStart("c1", "k0", SIZE, tenant="a"))
    r = h(PutEnd("c1", "k0", SIZE, tenant="a"))  # + a reservation (in no tenant yet)
    assert r.placeholder and m.row("a").memory_used == SIZE
    r = h(PutCommit("c1", r.placeholder, "k1", SIZE, tenant="a"))
    assert (m.row("a").memory_used, m.row("a").objects) == (2 * SIZE, 2)
    m.leases_end()
    r = h(PutCommit("c1", r.placeholder, "k2", SIZE, tenant="a"))  # at the quota: k0 goes
    assert m.exists("a", "k0", "k1", "k2") == [False, True, True]
    a = m.row("a")
    assert (a.memory_used, a.objects, a.evictions, a.refusals) == (2 * SIZE, 2, 1, 0)
    assert m.read("b", "k0") == [0]
    # k1 and k2 read-leased: nothing of a's may go
    assert m.read("a", "k1", "k2") == [0, 0]
    before = _state(m)
    pending = len(m.d.pending)
    m.d.records.clear()
    with pytest.raises(KVPoolError) as ei:
        h(PutCommit("c1", r.placeholder, "k3", SIZE, tenant="a"))
    assert ei.value.code == ErrorCode.QUOTA_EXCEEDED
    assert _state(m) == before and m.d.records == []  # nothing journaled
    assert m.exists("a", "k3") == [False]
    assert m.row("a").refusals == 1
    # the reservation is released (no new one made): its space held for late writes only
    assert len(m.d.pending) == pending - 1
    with pytest.raises(KVPoolError) as ei:
        h(PutRevoke("c1", r.placeholder))
    assert ei.value.code == ErrorCode.OBJECT_NOT_FOUND
    m.clock.t += m.d.writes.write_window_s + 1
    m.d.writes.sweep()
    assert m.d.pool_used[SegmentKind.MEMORY] == before[2][SegmentKind.MEMORY] - SIZE
    # a tenant without a quota (and the default tenant) commits reservations freely
    for tenant in ("b", ""):
        h(PutStart("c1", "x0", SIZE, tenant=tenant))
        r = h(PutEnd("c1", "x0", SIZE, tenant=tenant))
        for i in range(1, 4):
            r = h(PutCommit("c1", r.placeholder, f"x{i}", SIZE, tenant=tenant))
        assert m.exists(tenant, "x0", "x1", "x2", "x3") == [True] * 4
    assert m.read("b", "k0") == [0]


def test_batch_put_commit_of_reservations_is_held_to_the_quota() -> None:
    m = Master(tenants={"a": {"memory": 3 * SIZE}})
    h = m.h.handle
    assert m.put("b", "k0", "k1") == [0, 0]
    h(BatchPutStart("c1", ["k0"], [SIZE], PutOptions(), tenant="a"))
    r = h(BatchPutEnd("c1", ["k0"], SIZE, 1, tenant="a"))
    assert len(r.placeholders) == 1
    r = h(BatchPutCommit("c1", r.placeholders, ["k1"], SIZE, 2, tenant="a"))
    assert len(r.placeholders) == 1  # no more than the commit had keys
    # a second reservation (another batch of one), then a batch of two at the quota
    h(BatchPutStart("c1", ["k2"], [SIZE], PutOptions(), tenant="a"))
    r2 = h(BatchPutEnd("c1", ["k2"], SIZE, 1, tenant="a"))
    assert m.row("a").memory_used == 3 * SIZE
    m.leases_end()
    got = h(BatchPutCommit("c1", [r.placeholders[0], r2.placeholders[0]], ["k3", "k4"], SIZE,
                           2, tenant="a"))
    assert list(got.codes) == [0, 0]  # a's two least recent (k0, k1) made room
    assert m.exists("a", "k0", "k1", "k2", "k3", "k4") == [False, False, True, True, True]
    a = m.row("a")
    assert (a.memory_used, a.objects, a.evictions) == (3 * SIZE, 3, 2)
    assert m.exists("b", "k0", "k1") == [True, True]
    # every object of a's read-leased: the batch is refused key by key, nothing changes
    assert len(got.placeholders) == 2
    assert m.read("a", "k2", "k3", "k4") == [0, 0, 0]
    before = _state(m)
    pending = len(m.d.pending)
    m.d.records.clear()
    ref = h(BatchPutCommit("c1", list(got.placeholders), ["k5", "k6"], tenant="a"))
    assert list(ref.codes) == [QUOTA, QUOTA]
    assert _state(m) == before and m.d.records == []
    assert len(m.d.pending) == pending - 2  # released
    assert list(h(BatchPutRevoke("c1", list(got.placeholders))).codes) == [
        int(ErrorCode.OBJECT_NOT_FOUND)] * 2
    assert m.row("a").refusals == 2
    assert m.exists("a", "k5", "k6") == [False, False]


def test_hits_and_misses_count_for_the_readers_tenant_only() -> None:
    """Each tenant's row counts its own reads; the untracked default tenant's
    are its own (not the pool's less the others'), carried over when it
    becomes tracked; a tenant that never stored anything counts nothing."""
    m = Master()
    assert m.put("a", "k0") == [0]
    assert m.put("", "d0") == [0]
    assert m.exists("a", "k0", "nope") == [True, False]
    assert m.read("a", "k0") == [0]
    assert m.exists("", "d0", "d1", "d2") == [True, False, False]
    assert m.exists("never", "k0") == [False]  # a read alone does not make a tenant
    a, d = m.row("a"), m.row("default")
    assert (a.hits, a.misses) == (2, 1)
    assert (d.hits, d.misses) == (1, 2)
    assert "never" not in {r.name for r in m.h.handle(TenantList()).tenants}
    m.h.handle(TenantSet("default", 1 << 20, -1, -1))  # tracked from now on
    assert m.exists("", "d0") == [True]
    d = m.row("default")
    assert (d.hits, d.misses) == (2, 2)
    assert (m.row("a").hits, m.row("a").misses) == (2, 1)
