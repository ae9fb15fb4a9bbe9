"""The master's tiering policy over a real Directory (pure logic, controllable
clock): offload on eviction, promotion on hit, task failure/expiry, journal
replay of tier changes, file segments outliving their owner, takeover."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master import tiering
from kvpool.master.config import MasterConfig, load_master_config
from kvpool.master.directory import HARD_PIN, Directory, SegState
from kvpool.master.records import Put
from kvpool.master.tiering import TaskKind, TieringConfig, TieringPolicy

MEM = SegmentKind.MEMORY
FILE = SegmentKind.FILE
KiB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tier: dict[str, Any] | None = None, **cfg: Any) -> tuple[Directory, TieringPolicy, Clock]:
    clock = Clock()
    policy = TieringPolicy(TieringConfig(**(tier or {})), clock=clock)
    cfg.setdefault("eviction_high_watermark", 0.8)
    cfg.setdefault("eviction_ratio", 0.2)
    return Directory(MasterConfig(**cfg), clock=clock, hooks=policy), policy, clock


def desc(sid: str, size: int, kind: SegmentKind, client: str = "node",
         host: str = "h1", gen: int = 1) -> SegmentDescriptor:
    name = f"/disk/{sid}.kvseg" if kind == FILE else f"kvpool-{sid}"
    return SegmentDescriptor(sid, client, host, kind, size, name,
                             base_offset=4096 if kind == FILE else 0,
                             extra={"generation": gen} if kind == FILE else {})


def put(d: Directory, key: str, size: int, client: str = "writer", **kw: Any) -> int:
    code, _ = d.put_start(client, key, size, **kw)
    return code or d.put_end(client, key)


def kinds(d: Directory, key: str) -> list[SegmentKind]:
    return [s.kind for s in d.objects[key].replicas[::2]]


def run_tasks(d: Directory, p: TieringPolicy, client: str = "node", ok: bool = True) -> list[Any]:
    tasks, segs = p.tasks_for(d, client)
    for t in tasks:
        assert t["src"][0] in segs and t["dst"][0] in segs
        assert p.complete(d, client, t["id"], ok) == ErrorCode.OK
    return tasks


def fill_memory(d: Directory, n: int = 10) -> None:
    for i in range(n):
        assert put(d, f"k{i}", 100 * KiB) == ErrorCode.OK


def test_offload_on_eviction_moves_objects_to_disk() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)  # 10 x 100 KiB in 1 MiB: crosses the 80% watermark
    assert p.counters["offload_started"] > 0
    # nothing evicted yet: the objects wait for their copy, all still in memory
    assert all(kinds(d, f"k{i}") == [MEM] for i in range(10))
    d.records.clear()
    tasks = run_tasks(d, p)
    assert tasks and all(t["kind"] == TaskKind.OFFLOAD for t in tasks)
    moved = [t["key"] for t in tasks]
    for key in moved:
        assert kinds(d, key) == [FILE]  # readable from disk only
        code, (_obj, reps) = d.get_replicas(key)
        assert code == ErrorCode.OK and reps[0].id == "disk"
    assert d.pool_used[MEM] < 0.8 * d.pool_cap[MEM]
    assert d.pool_used[FILE] >= len(moved) * 100 * KiB
    # one PUT record per move, naming only the disk replica
    puts = [r for r in d.records if isinstance(r, Put)]
    assert [r.key for r in puts] == moved and all(r.replicas[0] == "disk" for r in puts)
    assert p.stats()["tier_tasks_inflight"] == 0 and p.inflight_bytes == 0


def test_tasks_are_handed_out_once_and_only_to_the_owner() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("disknode", desc("disk", 8192 * KiB + 4096, FILE, client="disknode"))
    fill_memory(d)
    assert p.tasks_for(d, "disknode") == ([], {})  # the copier is the memory owner
    first, _ = p.tasks_for(d, "node")
    assert first and p.tasks_for(d, "node")[0] == []
    assert p.complete(d, "disknode", first[0]["id"], True) == ErrorCode.INVALID_WRITE
    assert p.complete(d, "node", 999_999, True) == ErrorCode.OBJECT_NOT_FOUND


def test_same_host_file_segment_preferred() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM, host="h1"))
    d.mount("far", desc("disk-far", 64 * 1024 * KiB, FILE, client="far", host="h2"))
    d.mount("node", desc("disk-near", 8192 * KiB + 4096, FILE, host="h1"))
    fill_memory(d)
    tasks, _ = p.tasks_for(d, "node")
    assert tasks and all(t["dst"][0] == "disk-near" for t in tasks)


def test_failed_offload_frees_disk_and_then_evicts_plainly() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)
    tasks = run_tasks(d, p, ok=False)
    assert tasks and d.pool_used[FILE] == 0
    assert p.counters["offload_failed"] == len(tasks)
    failed_key = tasks[0]["key"]
    assert kinds(d, failed_key) == [MEM]  # still readable from memory
    d.evict(MEM)  # the next round drops the failed ones without another copy
    assert failed_key not in d.objects


def test_expired_tasks_release_their_allocation() -> None:
    d, p, clock = make({"task_timeout_s": 5})
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)
    n = p.counters["offload_started"]
    assert n and d.pool_used[FILE] > 0
    clock.t += 6
    d.touch("node")
    d.touch("writer")
    assert p.expire_tasks(d) == n
    assert d.pool_used[FILE] == 0 and not p.tasks


def test_disk_full_falls_back_to_plain_eviction() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 64 * KiB + 4096, FILE))  # smaller than one object
    fill_memory(d)
    assert p.counters["offload_started"] == 0 and p.counters["offload_no_space"] > 0
    assert len(d.objects) < 10  # evicted the ordinary way, no crash


def test_offload_disabled_and_auto_without_disk() -> None:
    for tier, disk in (({"offload_on_evict": False}, True), ({}, False)):
        d, p, _ = make(tier)
        d.mount("node", desc("mem", 1024 * KiB, MEM))
        if disk:
            d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
        fill_memory(d)
        assert p.counters["offload_started"] == 0 and len(d.objects) < 10


def test_put_that_memory_cannot_take_spills_to_disk() -> None:
    """Memory full and every eviction victim waiting for its copy: the put
    lands on the file segment at once instead of failing; the object is an
    ordinary disk-resident object (promoted on a hit)."""
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    for i in range(30):  # 3x the memory, no task ever completes meanwhile
        assert put(d, f"k{i}", 100 * KiB) == ErrorCode.OK
    spilled = [f"k{i}" for i in range(30) if kinds(d, f"k{i}") == [FILE]]
    assert len(spilled) >= 15 and d.stats()["spilled"] == len(spilled)
    assert d.pool_used[MEM] <= d.pool_cap[MEM]
    run_tasks(d, p)  # the offloads finish: memory takes new puts again
    assert put(d, "after", 100 * KiB) == ErrorCode.OK and kinds(d, "after") == [MEM]
    code, (obj, reps) = d.get_replicas(spilled[-1])
    assert code == ErrorCode.OK
    for _ in range(2):  # promoted at its second read from disk
        p.on_disk_hit(d, spilled[-1], obj, reps)
    assert p.counters["promote_started"] == 1
    # offload off: the disk tier only takes what is asked for; the put fails
    d, p, _ = make({"offload_on_evict": False})
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    hard = [put(d, f"pinned{i}", 600 * KiB, flags=HARD_PIN) for i in range(2)]
    assert hard == [ErrorCode.OK, ErrorCode.NO_AVAILABLE_HANDLE]
    assert d.stats()["spilled"] == 0


def test_promotion_on_disk_hit() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    assert put(d, "cold", 100 * KiB, replica_num=0, disk_replica_num=1) == ErrorCode.OK
    assert kinds(d, "cold") == [FILE]
    code, (obj, reps) = d.get_replicas("cold")
    p.on_disk_hit(d, "cold", obj, reps)
    assert p.counters["promote_started"] == 0  # read once: the disk serves it
    p.on_disk_hit(d, "cold", obj, reps)  # read again: worth a copy in memory
    p.on_disk_hit(d, "cold", obj, reps)  # one task per key at a time
    assert p.counters["promote_started"] == 1
    tasks = run_tasks(d, p)
    assert [t["kind"] for t in tasks] == [TaskKind.PROMOTE]
    assert sorted(kinds(d, "cold")) == [MEM, FILE]
    # a memory hit does not promote again
    code, (obj, reps) = d.get_replicas("cold")
    assert code == ErrorCode.OK
    p.on_disk_hit(d, "cold", obj, reps)
    assert p.counters["promote_started"] == 1


def test_promotion_after_hits_setting_and_bounded_hit_memory() -> None:
    d, p, _ = make({"promote_after_hits": 1})
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    put(d, "cold", 100 * KiB, replica_num=0, disk_replica_num=1)
    _, (obj, reps) = d.get_replicas("cold")
    p.on_disk_hit(d, "cold", obj, reps)
    assert p.counters["promote_started"] == 1
    d, p, _ = make({"promote_after_hits": 3})
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    put(d, "cold", 100 * KiB, replica_num=0, disk_replica_num=1)
    _, (obj, reps) = d.get_replicas("cold")
    for n in (0, 0, 1):
        p.on_disk_hit(d, "cold", obj, reps)
        assert p.counters["promote_started"] == n
    assert "cold" not in p._hits  # counted hits are forgotten once promoted
    for i in range(tiering._HIT_MEMORY + 10):  # many one-hit keys: the memory stays bounded
        p._hit_enough(f"once{i}")
    assert len(p._hits) == tiering._HIT_MEMORY
    with pytest.raises(ConfigError):
        TieringConfig(promote_after_hits=0).validate()


def test_promotion_disabled() -> None:
    d, p, _ = make({"promote_on_hit": False})
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    put(d, "cold", 100 * KiB, replica_num=0, disk_replica_num=1)
    _, (obj, reps) = d.get_replicas("cold")
    p.on_disk_hit(d, "cold", obj, reps)
    assert not p.tasks


def test_removed_object_during_offload_is_not_resurrected() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)
    tasks, _ = p.tasks_for(d, "node")
    key = tasks[0]["key"]
    assert d.remove(key, force=True) == ErrorCode.OK
    for t in tasks:
        assert p.complete(d, "node", t["id"], True) == ErrorCode.OK
    assert key not in d.objects
    assert d.pool_used[FILE] == (len(tasks) - 1) * 100 * KiB


def test_journal_replay_reproduces_tier_moves() -> None:
    d, p, _ = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)
    run_tasks(d, p)
    records = list(d.records)
    r, _, _ = make()
    r.journaling = False
    for rec in records:
        r.apply_record(rec)
    assert {k: [s.id for s in o.replicas[::2]] for k, o in r.objects.items()} == \
        {k: [s.id for s in o.replicas[::2]] for k, o in d.objects.items()}
    for sid in ("mem", "disk"):
        assert r.segments[sid].alloc.used == d.segments[sid].alloc.used


def test_file_segment_outlives_its_owner_and_is_readopted() -> None:
    d, p, clock = make({"file_owner_ttl_s": 100}, client_ttl_s=5)
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    put(d, "ondisk", 10 * KiB, replica_num=0, disk_replica_num=1)
    seg = d.segments["disk"]
    assert p.on_owner_lost(d, seg)
    assert not p.on_owner_lost(d, d.segments["mem"])  # memory goes with its owner
    assert seg.state == SegState.AWAITING and p.file_awaiting["disk"][0] == clock.t + 100
    assert d.get_replicas("ondisk")[0] == ErrorCode.REPLICA_IS_NOT_READY
    clock.t += 50
    p.tick(d)  # before the deadline nothing happens
    assert d.segments["disk"].state == SegState.AWAITING
    # the restarted node (new client id) mounts the same segment id again
    d.mount("node2", desc("disk", 8192 * KiB + 4096, FILE, client="node2", gen=2))
    code, (_obj, reps) = d.get_replicas("ondisk")
    assert code == ErrorCode.OK and reps[0].owner == "node2"
    p.tick(d)
    assert not p.file_awaiting and d.segments["disk"].state == SegState.ACTIVE


def test_kept_file_segment_revived_by_its_owner_or_dropped_at_deadline() -> None:
    d, p, clock = make({"file_owner_ttl_s": 100}, client_ttl_s=5)
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    d.mount("other", desc("disk2", 8192 * KiB + 4096, FILE, client="other"))
    put(d, "a", 10 * KiB, replica_num=0, disk_replica_num=1, preferred=["disk"])
    put(d, "b", 10 * KiB, replica_num=0, disk_replica_num=1, preferred=["disk2"])
    assert p.on_owner_lost(d, d.segments["disk"]) and p.on_owner_lost(d, d.segments["disk2"])
    clock.t += 1
    d.ping("node")  # the same owner comes back (e.g. after a long partition)
    p.tick(d)
    assert d.segments["disk"].state == SegState.ACTIVE
    assert d.get_replicas("a")[0] == ErrorCode.OK
    clock.t += 200
    p.tick(d)  # "other" never returned
    assert "disk2" not in d.segments
    d.purge_step(1 << 20)
    assert "b" not in d.objects and "a" in d.objects


def test_takeover_needs_same_file_and_newer_generation() -> None:
    d, p, _ = make()
    d.mount("old", desc("disk", 8192 * KiB + 4096, FILE, client="old", gen=3))
    seg = d.segments["disk"]
    assert p.can_take_over(d, seg, desc("disk", 8192 * KiB + 4096, FILE, client="new", gen=4))
    assert not p.can_take_over(d, seg, desc("disk", 8192 * KiB + 4096, FILE, gen=3))
    assert not p.can_take_over(d, seg, desc("disk", 8192 * KiB + 4096, FILE, host="h9", gen=9))
    assert not p.can_take_over(d, seg, desc("disk", 4096 * KiB + 4096, FILE, gen=9))


def test_restored_file_segments_outlast_client_ttl() -> None:
    d, _p, _clock = make({"file_owner_ttl_s": 500}, client_ttl_s=5)
    d.journaling = False
    d.restore_segment(desc("disk", 8192 * KiB + 4096, FILE).to_wire())
    d.restore_segment(desc("mem", 1024 * KiB, MEM).to_wire())
    d.finish_restore()
    assert sorted(d.ping("node")[1]) == ["disk", "mem"]  # the owner back at once: both
    d2, p2, clock2 = make({"file_owner_ttl_s": 500}, client_ttl_s=5, client_grace_s=0)
    d2.journaling = False
    d2.restore_segment(desc("disk", 8192 * KiB + 4096, FILE).to_wire())
    d2.restore_segment(desc("mem", 1024 * KiB, MEM).to_wire())
    d2.finish_restore()
    clock2.t += 10
    d2.expire_step()  # owner not back: memory goes after ttl + grace, the file stays
    p2.tick(d2)
    assert "mem" not in d2.segments and d2.segments["disk"].state == SegState.AWAITING
    assert p2.file_awaiting["disk"][0] == clock2.t + 500
    d2.mount("node2", desc("disk", 8192 * KiB + 4096, FILE, client="node2", gen=2))
    assert d2.segments["disk"].state == SegState.ACTIVE


def test_offload_of_an_object_read_meanwhile_keeps_the_memory_replica() -> None:
    d, p, clock = make()
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)
    tasks, _ = p.tasks_for(d, "node")
    key = tasks[0]["key"]
    assert d.get_replicas(key)[0] == ErrorCode.OK  # a reader holds a lease now
    for t in tasks:
        p.complete(d, "node", t["id"], True)
    assert sorted(kinds(d, key)) == [MEM, FILE]
    clock.t += 10  # lease over: plain eviction frees memory, the disk copy stays
    d.evict_object(key, d.objects[key], MEM)
    assert kinds(d, key) == [FILE]


def test_tiering_config_block_loads_and_validates(tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[2] / "configs" / "master.yaml"
    cfg = load_master_config(shipped)
    cfg.validate()
    assert cfg.tiering == TieringConfig()  # the file documents the defaults
    bad = tmp_path / "m.yaml"
    bad.write_text("tiering:\n  offload_on_evict: sometimes\n")
    with pytest.raises(ConfigError):
        load_master_config(bad).validate()
    bad.write_text("tiering:\n  no_such_key: 1\n")
    with pytest.raises(ConfigError):
        load_master_config(bad)


def test_copy_ahead_makes_eviction_immediate() -> None:
    d, p, _ = make({"offload_ahead_watermark": 0.5}, eviction_high_watermark=0.9,
                   eviction_ratio=0.1)
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    for i in range(7):  # 700 KiB of 1 MiB: above 0.5, below the eviction watermark
        assert put(d, f"k{i}", 100 * KiB) == ErrorCode.OK
    assert p.counters["offload_started"] == 0
    p.tick(d)
    tasks = run_tasks(d, p)
    assert tasks and all(t["kind"] == TaskKind.COPY for t in tasks)
    copied = {t["key"] for t in tasks}
    assert all(sorted(kinds(d, k)) == [MEM, FILE] for k in copied)  # memory kept
    p.tick(d)
    assert not p.tasks  # nothing copied twice
    for i in range(7, 10):  # now cross the eviction watermark
        assert put(d, f"k{i}", 100 * KiB) == ErrorCode.OK
    d.evict(MEM)
    evicted = [k for k in copied if kinds(d, k) == [FILE]]
    assert evicted  # freed at once: they already had a disk copy
    assert not any(t.key in evicted for t in p.tasks.values())  # no copy needed for them
    for k in copied:
        assert d.get_replicas(k)[0] == ErrorCode.OK


def test_copies_landing_above_the_watermark_free_memory_without_a_put() -> None:
    """Memory filled up while its copies to disk ran (puts spilled to disk):
    when the copies land, watermark eviction runs in the loop at once, not at
    the next put, so a disk hit read right after finds room for a promotion
    (the Mooncake promotion test failed when every memory object had been
    copied and nothing was put afterwards)."""
    d, p, _ = make({"offload_ahead_watermark": 0.5}, eviction_high_watermark=0.9,
                   eviction_ratio=0.1)
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    for i in range(7):
        assert put(d, f"k{i}", 100 * KiB) == ErrorCode.OK
    p.tick(d)  # copy-ahead queued, not run yet
    for i in range(7, 14):  # past the watermark: the in-flight copies hold memory
        assert put(d, f"k{i}", 100 * KiB) == ErrorCode.OK
    cap = d.pool_cap[MEM]
    assert d.pool_used[MEM] > 0.9 * cap
    spilled = [f"k{i}" for i in range(14) if kinds(d, f"k{i}") == [FILE]]
    assert spilled
    assert MEM not in d.evictor.evicting
    tasks = run_tasks(d, p)
    assert tasks and {t["kind"] for t in tasks} <= {TaskKind.COPY, TaskKind.OFFLOAD}
    assert MEM in d.evictor.evicting  # the copies made memory evictable
    while d.evictor.evicting:
        d.evictor.step()
    assert d.pool_used[MEM] <= 0.8 * cap + 100 * KiB
    for i in range(14):  # nothing lost: every object still has a replica
        assert d.get_replicas(f"k{i}")[0] == ErrorCode.OK
    _, (obj, reps) = d.get_replicas(spilled[0])
    for _ in range(2):
        p.on_disk_hit(d, spilled[0], obj, reps)
    assert p.counters["promote_started"] == 1
    run_tasks(d, p)
    assert sorted(kinds(d, spilled[0])) == [MEM, FILE]


def test_copy_ahead_off_and_without_disk() -> None:
    for tier, disk in (({"offload_ahead_watermark": 0}, True), ({}, False)):
        d, p, _ = make(tier)
        d.mount("node", desc("mem", 1024 * KiB, MEM))
        if disk:
            d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
        for i in range(7):
            put(d, f"k{i}", 100 * KiB)
        assert p.copy_ahead(d) == 0 and not p.tasks


def test_tier_counters_in_metrics() -> None:
    from prometheus_client import generate_latest

    from kvpool.master.metrics import make_registry
    from kvpool.master.server import MasterServer

    server = MasterServer(MasterConfig(port=0, metrics_port=0))
    try:
        server.tiering.counters["offload_done"] = 3
        text = generate_latest(make_registry(server)).decode()
        assert 'kvpool_master_tier_events_total{event="offload_done"} 3.0' in text
        assert "kvpool_master_tier_tasks_inflight 0.0" in text
        assert "kvpool_master_file_segments_awaiting 0.0" in text
    finally:
        server.close()


def test_cancelled_task_keeps_its_destination_until_the_node_reports() -> None:
    d, p, clock = make({"task_timeout_s": 10})
    d.mount("node", desc("mem", 1024 * KiB, MEM))
    d.mount("node", desc("disk", 8192 * KiB + 4096, FILE))
    fill_memory(d)
    clock.t += 3
    tasks, _ = p.tasks_for(d, "node")  # handed out: the node may be copying now
    assert tasks and all(t["ttl_ms"] == 10_000 for t in tasks)
    assert all(p.tasks[t["id"]].deadline == clock.t + 10 for t in tasks)
    key = tasks[0]["key"]
    used = d.pool_used[FILE]
    assert d.remove(key, force=True) == ErrorCode.OK
    assert put(d, key, 100 * KiB) == ErrorCode.OK  # same key, a new object
    p.on_evict(d, key, d.objects[key], MEM)  # finds the stale task: cancels it
    assert p.tasks[tasks[0]["id"]].cancelled
    assert d.pool_used[FILE] >= used  # not freed while a late copy could land there
    assert p.complete(d, "node", tasks[0]["id"], True) == ErrorCode.OK
    assert tasks[0]["id"] not in p.tasks and kinds(d, key) == [MEM]  # new object untouched
