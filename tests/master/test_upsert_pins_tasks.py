"""Directory and tier-policy logic of upsert, soft-pin TTLs, replica clear and
replica jobs (Mooncake's copy/move tasks), with a controllable clock; the
journal records they emit replay to the same state."""

from __future__ import annotations

from typing import Any

from kvpool.core.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.directory import HARD_PIN, SOFT_PIN, Directory
from kvpool.master.tiering import JobStatus, TaskKind, TieringConfig, TieringPolicy
from support.clock import Clock
from support.directory import MEM, mount, put


def make(**cfg: Any) -> tuple[Directory, Clock, TieringPolicy]:
    clock = Clock()
    pol = TieringPolicy(TieringConfig(), clock=clock)
    return Directory(MasterConfig(**cfg), clock=clock, hooks=pol, shard_bits=0), clock, pol


def where(d: Directory, key: str) -> list[tuple[str, int]]:
    reps = d.objects[key].replicas
    return [(reps[i].id, reps[i + 1]) for i in range(0, len(reps), 2)]


def replay(d: Directory) -> Directory:
    """A fresh directory fed every journal record ``d`` emitted."""
    fresh = Directory(d.cfg, clock=d.clock, shard_bits=0)
    for rec in d.records:
        fresh.apply_record(rec)
    return fresh


# ---------------------------------------------------------------- upsert


def test_upsert_keeps_old_readable_until_commit_then_frees_after_lease() -> None:
    d, clock, _ = make(lease_ttl_ms=1000)
    mount(d, "s", 1 << 20)
    assert put(d, "k", 100, flags=HARD_PIN) == 0
    old = where(d, "k")
    assert d.reads.exist_many(["k"])[1][0]  # a reader holds a lease on the old replica
    assert d.put_start("c1", "k", 100)[0] == ErrorCode.OBJECT_ALREADY_EXISTS
    code, _ = d.put_start("c2", "k", 300, replace=True)
    assert code == ErrorCode.OK
    # until the commit the old object is what readers get
    assert d.get_replicas("k")[1][0].size == 100
    assert d.put_end("c2", "k") == ErrorCode.OK
    obj = d.objects["k"]
    assert obj.size == 300 and obj.writer == "c2" and obj.flags & HARD_PIN  # hard pin kept
    assert where(d, "k") != old
    used = d.pool_used[MEM]
    d.writes.sweep()
    assert d.pool_used[MEM] == used  # old space held while its lease lasts
    clock.t += 1.5
    d.writes.sweep()
    assert d.pool_used[MEM] == used - 128
    assert d.writes.replaced == 1
    again = replay(d)
    assert again.objects["k"].size == 300 and len(again.objects) == 1


def test_upsert_of_missing_key_inserts_and_preempts_a_pending_put() -> None:
    d, _, _ = make()
    mount(d, "s", 1 << 20)
    assert d.put_start("c1", "k", 64)[0] == ErrorCode.OK  # in flight, not committed
    assert d.put_start("c2", "k", 64)[0] == ErrorCode.OBJECT_ALREADY_EXISTS
    assert d.put_start("c2", "k", 64, replace=True)[0] == ErrorCode.OK
    assert d.put_end("c1", "k") == ErrorCode.INVALID_WRITE  # its put was preempted
    assert d.put_end("c2", "k") == ErrorCode.OK and d.writes.preemptions == 1


# ---------------------------------------------------------------- soft pins


def fill_and_evict(d: Directory, tag: str, n: int) -> None:
    """Put ``n`` unpinned objects (pushing the segment past its watermark)."""
    for i in range(n):
        assert put(d, f"{tag}{i}", 64) == 0


def test_soft_pin_ttl_expires_and_zero_ttl_is_ordinary() -> None:
    # 10 objects fit; above 7 eviction brings the segment down to 4
    d, clock, _ = make(eviction_high_watermark=0.7, eviction_ratio=0.3, soft_pin_ttl_ms=60_000)
    mount(d, "s", 64 * 10)
    assert put(d, "short", 64, flags=SOFT_PIN, soft_pin_ms=1000) == 0
    assert put(d, "default", 64, flags=SOFT_PIN) == 0
    assert put(d, "zero", 64, flags=SOFT_PIN, soft_pin_ms=0) == 0
    assert not d.objects["zero"].flags & SOFT_PIN
    assert d.soft_until["default"] == clock.t + 60.0
    fill_and_evict(d, "a", 5)
    assert "short" in d.objects and "default" in d.objects and "zero" not in d.objects
    clock.t += 2.0  # the short pin ended: ordinary cache, oldest first
    fill_and_evict(d, "b", 4)
    assert "short" not in d.objects and "default" in d.objects
    assert "short" not in d.soft_until


def test_upsert_soft_pin_actions() -> None:
    d, clock, _ = make(soft_pin_ttl_ms=60_000)
    mount(d, "s", 1 << 20)
    assert put(d, "k", 64, flags=SOFT_PIN, soft_pin_ms=5000) == 0
    deadline = d.soft_until["k"]
    clock.t += 1.0
    assert put(d, "k", 64, replace=True) == 0  # PRESERVE: same deadline
    assert d.objects["k"].flags & SOFT_PIN and d.soft_until["k"] == deadline
    assert put(d, "k", 64, replace=True, flags=SOFT_PIN, soft_pin_ms=9000) == 0  # ENABLE anew
    assert d.soft_until["k"] == clock.t + 9.0
    assert put(d, "k", 64, replace=True, unpin=True) == 0  # DISABLE
    assert not d.objects["k"].flags & SOFT_PIN and "k" not in d.soft_until
    assert put(d, "n", 64) == 0 and "n" not in d.soft_until  # PRESERVE of a new key: none


# ---------------------------------------------------------------- replica clear


def test_replica_clear_segment_writer_and_lease() -> None:
    d, clock, _ = make(lease_ttl_ms=1000)
    mount(d, "a", 1 << 20)
    mount(d, "b", 1 << 20)
    assert put(d, "k", 64, replica_num=2) == 0
    assert d.removal.clear_many("c2", ["k"], "a")[0] == ErrorCode.PERMISSION_DENIED
    assert d.reads.exist_many(["k"])[1][0]
    assert d.removal.clear_many("c1", ["k"], "a")[0] == ErrorCode.OBJECT_HAS_LEASE
    clock.t += 2
    assert d.removal.clear_many("c1", ["k"], "nope")[0] == ErrorCode.OBJECT_NOT_FOUND
    assert d.removal.clear_many("c1", ["k"], "a")[0] == ErrorCode.OK
    assert [s for s, _ in where(d, "k")] == ["b"] and "k" not in d.segments["a"].keys
    assert d.pool_used[MEM] == 64
    assert [s for s, _ in where(replay(d), "k")] == ["b"]
    # the last one: the object goes
    assert d.removal.clear_many("c1", ["k"], "b")[0] == ErrorCode.OK
    assert "k" not in d.objects and d.pool_used[MEM] == 0
    assert "k" not in replay(d).objects
    assert d.removal.clear_many("c1", ["missing"])[0] == ErrorCode.OBJECT_NOT_FOUND


# ---------------------------------------------------------------- replica jobs


def run_tasks(d: Directory, pol: TieringPolicy, client: str, ok: bool = True) -> int:
    wires, _ = pol.tasks_for(d, client)
    for w in wires:
        assert pol.complete(d, client, w["id"], ok, "" if ok else "disk on fire") == 0
    return len(wires)


def test_copy_job_to_named_segments() -> None:
    d, _, pol = make()
    for s, c in (("a", "c1"), ("b", "c2"), ("c", "c3")):
        mount(d, s, 1 << 20, client=c)
    assert put(d, "k", 100, preferred=["a"]) == 0
    code, job = pol.create_job(d, "k", ["b", "c", "b"])
    assert code == ErrorCode.OK and job is not None and job.left == 2
    assert job.status == JobStatus.PENDING and job.executor == "c1"
    assert pol.create_job(d, "k", ["b"])[0] == ErrorCode.OBJECT_HAS_REPLICATION_TASK
    assert run_tasks(d, pol, "c1") == 2
    assert job.status == JobStatus.SUCCESS
    assert sorted(s for s, _ in where(d, "k")) == ["a", "b", "c"]
    assert sorted(s for s, _ in where(replay(d), "k")) == ["a", "b", "c"]
    # every target holds one already: done at once, nothing copied
    code, again = pol.create_job(d, "k", ["b"])
    assert code == ErrorCode.OK and again is not None and again.status == JobStatus.SUCCESS
    assert not pol.tasks


def test_move_job_and_failures() -> None:
    d, clock, pol = make(lease_ttl_ms=1000)
    for s, c in (("a", "c1"), ("b", "c2")):
        mount(d, s, 1 << 20, client=c)
    assert put(d, "k", 100, preferred=["a"]) == 0
    assert pol.create_job(d, "nope", ["b"])[0] == ErrorCode.OBJECT_NOT_FOUND
    assert pol.create_job(d, "k", ["zz"])[0] == ErrorCode.INVALID_PARAMS
    assert pol.create_job(d, "k", [])[0] == ErrorCode.INVALID_PARAMS
    assert pol.create_job(d, "k", ["a"], "a")[0] == ErrorCode.INVALID_PARAMS
    assert pol.create_job(d, "k", ["a"], "b")[0] == ErrorCode.INVALID_PARAMS  # b holds none
    code, job = pol.create_job(d, "k", ["b"], "a")
    assert code == ErrorCode.OK and job is not None and job.move
    assert next(iter(pol.tasks.values())).kind is TaskKind.REPLICA_MOVE
    assert d.reads.exist_many(["k"])[1][0]  # a reader is on the source replica
    assert run_tasks(d, pol, "c1") == 1
    assert job.status == JobStatus.SUCCESS and [s for s, _ in where(d, "k")] == ["b"]
    assert d.segments["a"].alloc.used == 128  # held for the reader's lease
    clock.t += 2
    d.writes.sweep()
    assert d.segments["a"].alloc.used == 0
    assert [s for s, _ in where(replay(d), "k")] == ["b"]
    # a failed copy fails the job and frees the destination
    code, bad = pol.create_job(d, "k", ["a"])
    assert code == ErrorCode.OK and bad is not None
    assert run_tasks(d, pol, "c2", ok=False) == 1
    assert bad.status == JobStatus.FAILED and "disk on fire" in bad.message
    assert d.segments["a"].alloc.used == 0 and [s for s, _ in where(d, "k")] == ["b"]


def test_job_fails_when_object_replaced_meanwhile() -> None:
    d, _, pol = make()
    for s, c in (("a", "c1"), ("b", "c2")):
        mount(d, s, 1 << 20, client=c)
    assert put(d, "k", 100, preferred=["a"]) == 0
    _, job = pol.create_job(d, "k", ["b"])
    assert job is not None
    wires, _ = pol.tasks_for(d, "c1")
    assert job.status == JobStatus.PROCESSING
    assert put(d, "k", 100, replace=True, preferred=["a"]) == 0
    assert pol.complete(d, "c1", wires[0]["id"], True) == 0
    assert job.status == JobStatus.FAILED
    assert [s for s, _ in where(d, "k")] == ["a"] and d.segments["b"].alloc.used == 0


# ---------------------------------------------------------------- object groups


def test_group_read_leases_every_member_and_eviction_takes_the_group() -> None:
    d, clock, _ = make(lease_ttl_ms=1000, eviction_high_watermark=0.7, eviction_ratio=0.3)
    mount(d, "s", 64 * 10)
    for k in ("g1", "g2", "g3"):
        assert put(d, k, 64, group="kv") == 0
    assert put(d, "solo", 64, group="") == 0
    assert d.groups == {"kv": {"g1", "g2", "g3"}} and "solo" not in d.group_of
    assert d.get_replicas("g2")[0] == ErrorCode.OK
    for k in ("g1", "g3"):  # a read of one member leases the whole group
        assert d.remove(k) == ErrorCode.OBJECT_HAS_LEASE
    assert d.remove("solo") == ErrorCode.OK
    # an upsert cannot move an object to another group (or out of it)
    assert d.put_start("c1", "g1", 64, replace=True, group="other")[0] == \
        ErrorCode.INVALID_PARAMS
    assert d.put_start("c1", "g1", 64, replace=True, group="")[0] == ErrorCode.INVALID_PARAMS
    clock.t += 2
    assert put(d, "a", 64) == 0 and put(d, "b", 64) == 0
    assert put(d, "g1", 64, replace=True) == 0 and d.group_of["g1"] == "kv"  # kept
    # LRU order now g3 g2 a b g1; eviction down to 4 objects takes the LRU
    # victim g3 with its whole group (g1 too, the youngest), then a: b stays
    for i in range(3):
        assert put(d, f"n{i}", 64) == 0
    assert not any(k in d.objects for k in ("g1", "g2", "g3", "a"))
    assert "b" in d.objects and len(d.objects) == 4
    assert d.groups == {} and d.group_of == {}
    assert d.stats()["groups"] == 0


def test_dropped_segment_forgets_pins_and_groups() -> None:
    d, _, _ = make()
    mount(d, "s", 1 << 20)
    assert put(d, "k", 64, flags=SOFT_PIN, group="g") == 0
    assert d.soft_until and d.groups
    d.unmount("c1", "s")
    d.purge_step(100)
    assert not d.objects and d.soft_until == {} and d.groups == {} and d.group_of == {}
