"""Unit tests: directory logic (placement, leases, eviction, liveness, replay).

Time is a controllable clock passed to the Directory, so lease/TTL logic is
tested deterministically without sleeping.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.directory import HARD_PIN, SOFT_PIN, Directory, Obj, SegState, TierHooks
from support.directory import FILE, MEM, make, mount, put, reserve, seg_ids


def test_put_get_lifecycle_and_errors() -> None:
    d, _ = make()
    mount(d, "s1", 1 << 20)
    code, p = d.put_start("c1", "k", 100)
    assert code == ErrorCode.OK and p.replicas[1] == 0
    assert d.get_replicas("k")[0] == ErrorCode.REPLICA_IS_NOT_READY
    assert d.put_start("c1", "k", 100)[0] == ErrorCode.OBJECT_ALREADY_EXISTS
    assert d.put_end("other", "k") == ErrorCode.INVALID_WRITE
    assert d.put_end("c1", "k") == ErrorCode.OK
    assert d.put_start("c1", "k", 100)[0] == ErrorCode.OBJECT_ALREADY_EXISTS
    code, (obj, reps) = d.get_replicas("k")
    assert code == 0 and obj.size == 100 and reps[0].id == "s1"
    assert d.reads.sizes_many(["k"]) == ([0], [100])
    assert d.get_replicas("nope")[0] == ErrorCode.OBJECT_NOT_FOUND
    assert d.writes.revoke_many("c1", ["nope"])[0] == ErrorCode.OBJECT_NOT_FOUND


def test_revoke_frees_space_once_no_late_write_can_land() -> None:
    d, clock = make()
    mount(d, "s1", 4096)
    assert d.put_start("c1", "a", 4096)[0] == 0
    assert d.put_start("c1", "b", 64)[0] == ErrorCode.NO_AVAILABLE_HANDLE
    assert d.writes.revoke_many("c1", ["a"])[0] == 0
    # the revoked writer's WRITE capability is still valid: a write of it that
    # is late (a stalled peer, a copy thread) must not land in another object
    d.writes.sweep()
    assert d.pool_used[MEM] == 4096 and d.stats()["held_puts"] == 1
    assert d.put_start("c1", "b", 64)[0] == ErrorCode.NO_AVAILABLE_HANDLE
    clock.t += d.writes.write_window_s
    d.writes.sweep()
    assert d.pool_used[MEM] == 0 and d.stats()["held_puts"] == 0
    assert d.put_start("c1", "b", 4096)[0] == 0


def test_space_of_a_put_abandoned_long_ago_is_freed_at_once() -> None:
    d, clock = make(put_start_discard_timeout_s=1.0, put_start_release_timeout_s=5.0)
    mount(d, "s1", 4096)
    assert d.put_start("c1", "a", 4096)[0] == 0
    clock.t += d.writes.write_window_s  # the writer's capability is long expired
    assert d.put_start("c2", "a", 4096)[0] == 0  # preempted: its space reused at once
    assert d.writes.preemptions == 1


def test_replicas_on_distinct_segments_best_effort() -> None:
    d, _ = make()
    for i in range(3):
        mount(d, f"m{i}", 1 << 20)
    mount(d, "f0", 1 << 20, FILE)
    code, p = d.put_start("c1", "k", 1000, replica_num=5, disk_replica_num=2)
    assert code == 0
    segs = [s.id for s in p.replicas[::2]]
    assert len(segs) == len(set(segs)) == 4  # 3 memory + 1 file: fewer than asked is fine
    assert sorted(s for s in segs if s.startswith("m")) == ["m0", "m1", "m2"]
    assert "f0" in segs
    # file replicas are 4 KiB aligned
    off = p.replicas[segs.index("f0") * 2 + 1]
    assert off % 4096 == 0


def test_preferred_segment_first_and_load_spread() -> None:
    d, _ = make()
    mount(d, "a", 1 << 20)
    mount(d, "b", 1 << 20)
    assert put(d, "k1", 1000, preferred=["b"]) == 0
    assert seg_ids(d, "k1") == ["b"]
    # most-free placement: the next object goes to the emptier segment
    assert put(d, "k2", 1000) == 0
    assert seg_ids(d, "k2") == ["a"]


def test_no_segment_gives_no_available_handle() -> None:
    d, _ = make()
    assert d.put_start("c1", "k", 10)[0] == ErrorCode.NO_AVAILABLE_HANDLE
    mount(d, "f", 1 << 20, FILE)
    # only a file segment, memory replica asked: NO_AVAILABLE_HANDLE too
    assert d.put_start("c1", "k", 10)[0] == ErrorCode.NO_AVAILABLE_HANDLE
    assert d.put_start("c1", "k", 10, replica_num=0, disk_replica_num=1)[0] == 0


def test_lease_blocks_remove_unless_forced_and_expires() -> None:
    d, clock = make(lease_ttl_ms=1000)
    mount(d, "s", 1 << 20)
    assert put(d, "k", 10) == 0
    assert d.remove("k") == 0  # never read: no lease
    assert put(d, "k", 10) == 0
    assert d.reads.exist_many(["k"])[1][0] is True
    assert d.remove("k") == ErrorCode.OBJECT_HAS_LEASE
    assert d.removal.lease_refusals == 1
    clock.t += 1.5
    assert d.get_replicas("k")[0] == 0  # renews the lease
    assert d.remove("k") == ErrorCode.OBJECT_HAS_LEASE
    assert d.remove("k", force=True) == 0
    assert d.remove("k") == ErrorCode.OBJECT_NOT_FOUND
    # the space stays held while the READ grants of the lease may still read it
    assert d.pool_used[MEM] == 64
    assert put(d, "k2", 1 << 20) == ErrorCode.NO_AVAILABLE_HANDLE
    clock.t += 0.5
    d.writes.sweep()
    assert d.pool_used[MEM] == 64
    clock.t += 0.6  # the lease ended
    d.writes.sweep()
    assert d.pool_used[MEM] == 0
    assert put(d, "k2", 1 << 20) == 0


def test_inflight_put_preempted_after_discard_timeout() -> None:
    d, clock = make(put_start_discard_timeout_s=5)
    mount(d, "s", 1 << 20)
    assert d.put_start("w1", "k", 100)[0] == 0
    clock.t += 2
    assert d.put_start("w2", "k", 100)[0] == ErrorCode.OBJECT_ALREADY_EXISTS
    clock.t += 4
    assert d.put_start("w2", "k", 100)[0] == 0
    assert d.writes.preemptions == 1
    assert d.put_end("w1", "k") == ErrorCode.INVALID_WRITE  # the old writer lost it
    assert d.put_end("w2", "k") == 0
    # w1 may still be writing with its capability: its space is held till that ends
    assert d.pool_used[MEM] == 256
    clock.t = 1000.0 + d.writes.write_window_s
    d.writes.sweep()
    assert d.pool_used[MEM] == 128


def test_eviction_watermark_respects_leases_and_pins() -> None:
    d, _ = make(shard_bits=0, eviction_high_watermark=0.9, eviction_ratio=0.2)  # exact LRU
    mount(d, "s", 64 * 100)
    for i in range(85):
        flags = HARD_PIN if i < 5 else (SOFT_PIN if i < 10 else 0)
        assert put(d, f"k{i}", 64, flags=flags) == 0
    for i in range(10, 20):
        assert d.reads.exist_many([f"k{i}"])[1][0]  # leased
    assert d.evictor.evictions == 0
    for i in range(85, 95):
        assert put(d, f"k{i}", 64) == 0
    # crossed 90% at k90: evicted down to 70% (70 objects), then k91..k94 were added
    assert d.evictor.evictions == 21
    assert d.pool_used[MEM] == (70 + 4) * 64
    for i in range(20):
        assert f"k{i}" in d.objects, f"k{i} (pinned or leased) was evicted"
    # LRU: the oldest unleased, unpinned objects went first
    assert "k20" not in d.objects and "k94" in d.objects


def test_soft_pinned_evicted_only_after_the_rest() -> None:
    d, _ = make(eviction_high_watermark=0.5, eviction_ratio=0.4)
    mount(d, "s", 64 * 10)
    for i in range(4):
        assert put(d, f"soft{i}", 64, flags=SOFT_PIN) == 0
    assert put(d, "plain", 64) == 0
    # pushes usage above 50%: target 10% (64 B) -> plain goes first, then soft ones
    assert put(d, "trigger", 64) == 0
    assert "plain" not in d.objects
    assert sum(k.startswith("soft") for k in d.objects) < 4
    assert d.pool_used[MEM] <= 64


def test_more_replicas_than_segments_evicts_nothing() -> None:
    """A put asking for more memory replicas than there are segments (one of
    two holders suspect, or simply too few holders) gets what the segments
    give, with room to spare: nothing else is evicted for the replica no
    segment can take. (It did evict: each such put threw the previous
    unleased objects away, put after put.)"""
    d, _ = make(shard_bits=0)
    mount(d, "a", 1 << 20)  # the only memory segment taking placements
    for i in range(8):
        assert put(d, f"k{i}", 4096, replica_num=2) == 0
    assert all(f"k{i}" in d.objects for i in range(8))
    assert all([s.id for s in d.objects[f"k{i}"].replicas[::2]] == ["a"] for i in range(8))
    # a segment that is really full still makes room (LRU eviction), as before
    d2, _ = make(shard_bits=0, eviction_high_watermark=1.0, eviction_ratio=0.0)
    mount(d2, "x", 4096 * 4)
    mount(d2, "y", 4096 * 8)
    for i in range(4):
        assert put(d2, f"k{i}", 4096, replica_num=2) == 0
    assert put(d2, "new", 4096, replica_num=2) == 0
    assert sorted(s.id for s in d2.objects["new"].replicas[::2]) == ["x", "y"]
    assert "k0" not in d2.objects  # evicted on x to make the second replica's room


def test_allocation_failure_triggers_eviction() -> None:
    d, _ = make(shard_bits=0, eviction_high_watermark=1.0, eviction_ratio=0.0)
    mount(d, "s", 64 * 4)
    for i in range(4):
        assert put(d, f"k{i}", 64) == 0
    assert d.reads.exist_many(["k0"])[1][0]  # leased: must survive
    assert put(d, "new", 128) == 0
    assert "k0" in d.objects and "k1" not in d.objects and "k2" not in d.objects


def test_hard_pinned_full_pool_gives_no_handle() -> None:
    d, _ = make()
    mount(d, "s", 64 * 2)
    assert put(d, "a", 64, flags=HARD_PIN) == 0
    assert put(d, "b", 64, flags=HARD_PIN) == 0
    assert d.put_start("c1", "c", 64)[0] == ErrorCode.NO_AVAILABLE_HANDLE
    assert {"a", "b"} <= set(d.objects)


def test_eviction_is_per_pool_and_keeps_other_tier() -> None:
    d, _ = make(eviction_high_watermark=0.5, eviction_ratio=0.25)
    mount(d, "m", 64 * 4)
    mount(d, "f", 4096 * 16, FILE)
    assert put(d, "k", 64, disk_replica_num=1) == 0
    assert put(d, "j", 64) == 0
    assert put(d, "z", 64) == 0  # 3/4 memory: evict k's memory replica, keep its file one
    assert "k" in d.objects and seg_ids(d, "k") == ["f"]
    assert d.pool_used[FILE] == 4096


def test_eviction_policy_hook_called() -> None:
    calls: list[tuple[str, SegmentKind]] = []

    class Offload(TierHooks):
        def on_evict(self, directory: Directory, key: str, obj: Obj, kind: SegmentKind) -> bool:
            calls.append((key, kind))
            return False

    d = Directory(MasterConfig(eviction_high_watermark=0.5, eviction_ratio=0.1), hooks=Offload(),
                  shard_bits=0)
    mount(d, "s", 64 * 4)
    for i in range(3):
        assert put(d, f"k{i}", 64) == 0
    assert calls and calls[0] == ("k0", MEM)


def test_unmount_and_dead_replicas_invisible_before_purge() -> None:
    d, _ = make(purge_slice=1)
    mount(d, "a", 1 << 20)
    assert put(d, "k", 10) == 0
    with pytest.raises(KVPoolError) as ei:
        d.unmount("intruder", "a")
    assert ei.value.code == ErrorCode.PERMISSION_DENIED
    d.unmount("c1", "a")
    assert d.get_replicas("k")[0] == ErrorCode.OBJECT_NOT_FOUND  # before the purge ran
    assert not d.reads.exist_many(["k"])[1][0]
    d.purge_step(10)
    assert "k" not in d.objects
    with pytest.raises(KVPoolError) as ei:
        d.unmount("c1", "a")
    assert ei.value.code == ErrorCode.SEGMENT_NOT_FOUND


def test_mount_twice_is_error() -> None:
    d, _ = make()
    mount(d, "a", 1 << 20)
    with pytest.raises(KVPoolError) as ei:
        mount(d, "a", 1 << 20)
    assert ei.value.code == ErrorCode.SEGMENT_ALREADY_EXISTS


def test_replay_reproduces_state_and_awaits_owner() -> None:
    d, _ = make(eviction_high_watermark=0.6, eviction_ratio=0.1)
    mount(d, "a", 64 * 10)
    mount(d, "b", 64 * 10, client="c2")
    for i in range(12):
        assert put(d, f"k{i}", 64, replica_num=1) == 0
    assert d.remove("k11") == 0
    d.unmount("c2", "b")
    records = list(d.records)
    r, _ = make()
    r.journaling = False
    for rec in records:
        r.apply_record(rec)
    r.finish_restore()
    r.journaling = True
    live = {k for k, o in d.objects.items() if any(s.state == SegState.ACTIVE
                                                   for s in o.replicas[::2])}
    assert set(r.objects) == live
    assert set(r.segments) == {"a"}
    assert r.segments["a"].state == SegState.AWAITING
    assert r.segments["a"].alloc.used == d.segments["a"].alloc.used
    assert r.get_replicas(next(iter(live)))[0] == ErrorCode.REPLICA_IS_NOT_READY
    remount, ids = r.ping("c1")
    assert not remount and ids == ["a"]
    assert r.get_replicas(next(iter(live)))[0] == 0
    # a restored segment whose owner never returns is dropped after client_ttl + grace
    r2, clock2 = make(client_ttl_s=1, client_grace_s=3)
    r2.journaling = False
    for rec in records:
        r2.apply_record(rec)
    r2.finish_restore()
    r2.journaling = True
    clock2.t += 2
    r2.liveness.expire_step()
    assert set(r2.segments) == {"a"}  # still within the grace
    clock2.t += 2.5
    r2.liveness.expire_step()
    assert not r2.segments


def test_sharded_eviction_is_approximately_lru() -> None:
    d, clock = make(lease_ttl_ms=1, eviction_high_watermark=0.9, eviction_ratio=0.3)
    mount(d, "s", 64 * 2000)
    for i in range(1790):
        assert put(d, f"k{i}", 64) == 0
    for i in range(1000, 1790):  # recently used
        assert d.get_replicas(f"k{i}")[0] == 0
    clock.t += 1  # leases over
    for i in range(1790, 1801):
        assert put(d, f"n{i}", 64) == 0  # crosses 90%: evict down to 60%
    gone = [i for i in range(1790) if f"k{i}" not in d.objects]
    assert len(gone) >= 500
    # nearly all victims are from the old, unread half
    assert sum(i < 1000 for i in gone) >= 0.9 * len(gone)


def test_eviction_order_is_global_lru_across_shards() -> None:
    """Few objects spread over 256 shards: eviction still takes the least
    recently used first (shards merged by use tick), not shard order."""
    d, clock = make(lease_ttl_ms=1, eviction_high_watermark=0.9, eviction_ratio=0.0)
    mount(d, "s", 64 * 20)
    for i in range(18):
        assert put(d, f"k{i}", 64) == 0
    for i in (0, 1, 2):  # read: now the most recently used
        assert d.get_replicas(f"k{i}")[0] == 0
    clock.t += 1  # leases over
    assert put(d, "new", 64) == 0  # 19/20 > 90%: evict down to 90% (1 object) ...
    assert put(d, "new2", 64) == 0
    gone = sorted(int(k[1:]) for k in (f"k{i}" for i in range(18)) if k not in d.objects)
    assert gone and gone == list(range(3, 3 + len(gone)))  # oldest unread first, in order


def test_watermark_eviction_proceeds_in_bounded_batches() -> None:
    d, _ = make(eviction_high_watermark=0.9, eviction_ratio=0.5, eviction_batch=10)
    mount(d, "s", 64 * 100)
    for i in range(91):
        assert put(d, f"k{i}", 64) == 0
    # crossing 90% evicted only one batch; the rest continues step by step
    assert d.evictor.evictions == 10 and d.evictor.evicting
    steps = 0
    while d.evictor.evicting:
        d.evictor.step()
        steps += 1
    assert steps == 5  # 10 + 4 x 10 + 1 = 51 evictions down to 40%
    assert d.pool_used[MEM] == 40 * 64 and d.evictor.evictions == 51
    # an allocation that cannot be satisfied evicts what it needs at once,
    # ignoring the batch limit (exact LRU: the 5 oldest leave one hole) ...
    d2, _ = make(shard_bits=0, eviction_high_watermark=1.0, eviction_ratio=0.0,
                 eviction_batch=1)
    mount(d2, "s", 64 * 10)
    for i in range(10):
        assert put(d2, f"k{i}", 64) == 0
    assert put(d2, "big", 64 * 5) == 0 and d2.evictor.evictions == 5
    # ... and with sharded (approximate) LRU, scattered holes make it retry with more
    d3, _ = make(eviction_high_watermark=1.0, eviction_ratio=0.0, eviction_batch=1)
    mount(d3, "s", 64 * 10)
    for i in range(10):
        assert put(d3, f"k{i}", 64) == 0
    assert put(d3, "big", 64 * 5) == 0 and 5 <= d3.evictor.evictions <= 10


def test_inflight_puts_of_expired_or_stuck_writers_are_released() -> None:
    d, clock = make(client_ttl_s=5, put_start_release_timeout_s=100)
    mount(d, "s", 1 << 20, client="owner")
    assert d.put_start("writer", "a", 1000)[0] == 0
    assert d.put_start("slow", "b", 1000)[0] == 0
    used = d.pool_used[MEM]
    for _ in range(3):  # owner and slow keep pinging; writer goes silent
        clock.t += 2
        d.ping("owner")
        d.ping("slow")
        d.liveness.expire_step()
    assert "writer" not in d.clients
    assert d.writes.sweep() == 1 and "a" not in d.pending and "b" in d.pending
    # a silent writer may be a stalled one: its space waits out its capability
    assert d.pool_used[MEM] == used and d.stats()["held_puts"] == 1
    clock.t = 1000.0 + d.writes.write_window_s
    d.ping("owner")
    d.ping("slow")
    assert d.writes.sweep() == 0 and d.pool_used[MEM] == used - 1024
    clock.t += 101
    d.ping("owner")
    d.ping("slow")
    assert d.writes.sweep() == 1 and not d.pending and d.pool_used[MEM] == 0


def test_put_commit_renames_a_reservation_and_commits_it() -> None:
    """A reservation is the caller's pending put under a placeholder key:
    PUT_COMMIT makes it the key's and commits it as PUT_END (one journal
    record of the key); an unused one is swept at its write window."""
    d, clock = make(put_start_discard_timeout_s=5)
    d.journaling = True
    mount(d, "s", 1 << 20)
    ph = "\x00resv/n/0"
    code, p = reserve(d, "c1", ph, 100)
    assert code == 0
    assert d.put_commit("c2", ph, "k") == ErrorCode.OBJECT_NOT_FOUND  # not c2's
    assert d.put_commit("c1", "\x00resv/n/9", "k") == ErrorCode.OBJECT_NOT_FOUND
    assert d.put_start("c2", "taken", 100)[0] == 0  # in flight: taken
    assert d.put_commit("c1", ph, "taken") == ErrorCode.OBJECT_ALREADY_EXISTS
    assert ph in d.pending  # the reservation stays
    d.records.clear()
    assert d.put_commit("c1", ph, "k") == 0
    assert ph not in d.pending and "k" not in d.pending
    code, (obj, reps) = d.get_replicas("k")
    assert code == 0 and obj.size == 100 and reps[1] == p.replicas[1]
    assert [r[1] for r in d.records] == ["k"]  # the PUT record of the key, as PUT_END's
    assert d.put_commit("c1", ph, "k2") == ErrorCode.OBJECT_NOT_FOUND  # used once
    # an unused reservation goes with its write window, long before release timeout
    assert reserve(d, "c1", "\x00resv/n/1", 100)[0] == 0
    clock.t += d.writes.write_window_s + 1
    assert d.writes.sweep() == 1
    assert "\x00resv/n/1" not in d.pending and "taken" in d.pending  # a plain put stays


def test_put_commit_many_is_put_commit_key_by_key() -> None:
    """BATCH_PUT_COMMIT's pass: each pair as PUT_COMMIT answers it (and records
    it: one PUT record per committed key, as PUT_END's), the reservations of
    refused keys kept; a grouped reservation takes put_end's general path, a
    stale in-flight put of the key is preempted."""
    d, clock = make(put_start_discard_timeout_s=5)
    d.journaling = True
    mount(d, "s", 1 << 20)
    phs = [f"\x00resv/n/{i}" for i in range(7)]
    codes = [0] * 6
    placed: list[Any] = [None] * 6
    d.writes.put_start_many("c1", phs[:6], [100] * 6, codes, placed, key_min="\x00")
    assert codes == [0] * 6 and all(placed)
    assert reserve(d, "c1", phs[6], 100, group="g")[0] == 0
    assert put(d, "stored", 10) == 0
    assert d.put_start("c2", "inflight", 10)[0] == 0
    assert d.put_start("c2", "stale", 10)[0] == 0
    clock.t += 6  # "stale" is past put_start_discard_timeout_s, "fresh" (below) is not
    assert d.put_start("c2", "fresh", 10)[0] == 0
    d.records.clear()
    keys = ["a", "stored", "fresh", "", "stale", "b", "grouped", "c"]
    pairs = [phs[0], phs[1], phs[2], phs[3], phs[4], "\x00resv/n/99", phs[6], phs[5]]
    got = d.writes.commit_many("c1", keys, pairs)
    assert got == [0, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.OBJECT_ALREADY_EXISTS,
                   ErrorCode.INVALID_KEY, 0, ErrorCode.OBJECT_NOT_FOUND, 0, 0]
    assert [r[1] for r in d.records] == ["a", "stale", "grouped", "c"]  # PUT records
    for key, ph in (("a", phs[0]), ("stale", phs[4]), ("c", phs[5]), ("grouped", phs[6])):
        assert ph not in d.pending and key not in d.pending
        assert d.get_replicas(key)[0] == 0
    assert d.group_of["grouped"] == "g"
    assert d.writes.preemptions == 1
    assert all(ph in d.pending for ph in phs[1:4])  # refused: still reserved
    assert d.writes.commit_many("c2", ["x"], [phs[1]]) == [ErrorCode.OBJECT_NOT_FOUND]
    with pytest.raises(ValueError):
        d.writes.commit_many("c1", ["x"], phs[:2])
