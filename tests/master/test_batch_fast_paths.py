"""Unit: the one-pass batch paths of the directory (put_start_many,
commit_many, exist_many, get_replicas_many and the batch_get_replica_list
handler over it) give exactly what the same ops give key by key, and
the journal's batch frames read back as the records they hold; the
allocator's in-place reserve matches allocate.

Two directories with controllable clocks get the same operations, one key
by key, the other batched; codes, placements, journal records and the
resulting state must be identical, through the edge cases the fast paths
hand to the general code (existing and in-flight keys, preemption, other
writers, eviction when the pool fills).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpool.core.capability import CapabilitySigner, CapOp
from kvpool.core.capability import decode as cap_decode
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import (
    BatchGetReplicaList,
    BatchGetReplicaListReply,
    GetReplicaList,
    GetReplicaListReply,
    PutStart,
    PutStartReply,
    ReplicaDescriptor,
    ReplicaStatus,
    SegmentDescriptor,
    SegmentKind,
)
from kvpool.master.allocator import Allocator
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory, Obj, Pending
from kvpool.master.grants import replica_descriptors
from kvpool.master.handlers import OpHandlers
from kvpool.master.journal import Journal, frame, read_journal
from kvpool.master.tiering import TieringConfig, TieringPolicy
from support.clock import Clock

MAX_KEY = 64
MAX_SIZE = 1 << 20


def make(segments: int, seg_size: int) -> tuple[Directory, Clock]:
    clock = Clock()
    cfg = MasterConfig(eviction_high_watermark=0.9, eviction_ratio=0.2,
                       put_start_discard_timeout_s=5.0, max_key_length=MAX_KEY,
                       max_object_size=MAX_SIZE)
    d = Directory(cfg, clock=clock)
    for i in range(segments):
        d.mount("c1", SegmentDescriptor(f"s{i}", "c1", "h", SegmentKind.MEMORY, seg_size,
                                        f"kvpool-s{i}"))
    d.records.clear()
    return d, clock


def per_key_start(d: Directory, client: str, keys: list[str], sizes: list[int]
                  ) -> tuple[list[int], list[Any]]:
    """Key by key: validate, then put_start (a batch of one)."""
    codes: list[int] = []
    out: list[Any] = []
    for key, size in zip(keys, sizes, strict=True):
        if not key or len(key) > MAX_KEY:
            codes.append(int(ErrorCode.INVALID_KEY))
            out.append(None)
        elif size <= 0 or size > MAX_SIZE:
            codes.append(int(ErrorCode.INVALID_PARAMS))
            out.append(None)
        else:
            code, p = d.put_start(client, key, size)
            codes.append(int(code))
            out.append(p.replicas if not code else None)
    return codes, out


def batch_start(d: Directory, client: str, keys: list[str], sizes: list[int]
                ) -> tuple[list[int], list[Any]]:
    codes = [0] * len(keys)
    out: list[Any] = [None] * len(keys)
    d.writes.put_start_many(client, keys, sizes, codes, out)
    return codes, out


def per_key_end(d: Directory, client: str, keys: list[str]) -> list[int]:
    return [int(d.put_end(client, k)) if k and len(k) <= MAX_KEY
            else int(ErrorCode.INVALID_KEY) for k in keys]


def placement(out: list[Any]) -> list[Any]:
    return [None if r is None else [(r[i].id, r[i + 1]) for i in range(0, len(r), 2)]
            for r in out]


def state(d: Directory) -> dict[str, Any]:
    objs = {k: (o.size, o.flags, o.writer, [(o.replicas[i].id, o.replicas[i + 1])
                                           for i in range(0, len(o.replicas), 2)])
            for k, o in d.objects.items()}
    lru = [k for k, _ in d.objects.lru_items()]
    pending = {k: (p.size, p.client_id, p.started) for k, p in d.pending.items()}
    segs = {s.id: (s.alloc.used, s.alloc.free, sorted(s.keys), s.alloc._starts, s.alloc._lens,
                   s.alloc._by_size) for s in d.segments.values()}
    return {"objects": objs, "lru": lru, "pending": pending, "segments": segs,
            "clients": dict(d.clients), "pool_used": dict(d.pool_used),
            "evictions": d.evictor.evictions, "preemptions": d.writes.preemptions,
            "held": len(d.writes._held)}


@pytest.mark.parametrize("segments", [4, 1])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batch_paths_match_per_key_paths(seed: int, segments: int) -> None:
    """(A pool of one segment: put_start_many carves runs of equal sizes at once.)"""
    rng = random.Random(seed)
    # small segments: the pool fills, so eviction (the general path) runs too
    a, ca = make(segments, 1 << 20)
    b, cb = make(segments, 1 << 20)
    names = [f"key-{i:04d}" for i in range(600)]
    for step in range(60):
        n = rng.randint(1, 40)
        keys = [rng.choice(names) for _ in range(n)]
        if rng.random() < 0.2:
            keys[0] = ""  # invalid key
        if rng.random() < 0.1:
            keys[-1] = "x" * (MAX_KEY + 1)
        sizes = [rng.choice([4096, 4096, 8192, 100, 0, 70_000]) for _ in range(n)]
        client = rng.choice(["c1", "c1", "c2"])
        got_a = per_key_start(a, client, keys, sizes)
        got_b = batch_start(b, client, keys, sizes)
        assert got_a[0] == got_b[0], step
        assert placement(got_a[1]) == placement(got_b[1]), step
        # upserts of stored keys (the end's general path: a replaced object)
        upserts = [k for k in dict.fromkeys(rng.choice(names) for _ in range(3))
                   if k in a.objects and k not in a.pending] if rng.random() < 0.3 else []
        for d in (a, b):
            for k in upserts:
                d.put_start(client, k, 4096, replace=True)
        # end most of them (some by another client, some twice), leave some in flight
        ends = [k for k in keys if rng.random() < 0.8] + [rng.choice(names)] + upserts
        end_client = client if rng.random() < 0.85 else "c3"
        assert per_key_end(a, end_client, ends) == b.writes.commit_many(end_client, ends)
        assert a.records == b.records, step
        a.records.clear()
        b.records.clear()
        probe = [rng.choice(names) for _ in range(20)] + ["", "y" * (MAX_KEY + 1)]
        found_a = [a.reads.exist_many([k])[1][0] for k in probe]  # key by key
        codes_b, found_b = b.reads.exist_many(probe)
        assert found_a == found_b
        assert codes_b == [0 if k and len(k) <= MAX_KEY else int(ErrorCode.INVALID_KEY)
                           for k in probe]
        assert state(a) == state(b), step
        # time passes: in-flight puts of the past become preemptible
        ca.t += rng.choice([0.0, 1.0, 6.0])
        cb.t = ca.t
    assert a.evictor.evictions > 0 and a.writes.preemptions > 0  # the general paths were exercised


def test_put_start_many_picks_the_most_free_segment_like_put_start() -> None:
    a, _ = make(3, 1 << 22)
    b, _ = make(3, 1 << 22)
    keys = [f"k{i}" for i in range(30)]
    sizes = [4096 * (1 + i % 3) for i in range(30)]
    _codes, out_a = per_key_start(a, "c1", keys, sizes)
    codes, out_b = batch_start(b, "c1", keys, sizes)
    assert codes == [0] * 30
    assert placement(out_a) == placement(out_b)
    assert len({r[0].id for r in out_b}) == 3  # spread over every segment


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_put_start_many_plans_runs_over_several_segments_like_put_start(seed: int) -> None:
    """Batches of equal sizes on 2-5 segments (put_start_many plans each run:
    round robin while the segments' free bytes are within one allocation,
    simulated otherwise, key by key when fragmented or full) place, carve
    and leave the allocators exactly as put_start key by key, with objects
    freed in between (fragmented segments) and pools that fill up."""
    rng = random.Random(seed)
    planned = 0
    for _trial in range(6):
        segments = rng.randint(2, 5)
        seg_size = rng.choice([1 << 18, 1 << 20])
        a, _ = make(segments, seg_size)
        b, _ = make(segments, seg_size)
        for step in range(40):
            n = rng.randint(1, 48)
            base = rng.randint(0, 10_000)
            keys = [f"k{base + i}" for i in range(n)]
            size = rng.choice([64, 4096, 4096, 8192, 70_000])
            sizes = [size] * n if rng.random() < 0.8 else \
                [rng.choice([size, 100]) for _ in range(n)]
            got_a = per_key_start(a, "c1", keys, sizes)
            got_b = batch_start(b, "c1", keys, sizes)
            assert got_a[0] == got_b[0], step
            assert placement(got_a[1]) == placement(got_b[1]), step
            planned += sum(1 for r in got_b[1] if r is not None)
            ends = [k for k in keys if rng.random() < 0.7]
            assert per_key_end(a, "c1", ends) == b.writes.commit_many("c1", ends)
            # free some stored objects: holes in the segments
            for k in [k for k in list(a.objects)[:200] if rng.random() < 0.3]:
                for d in (a, b):
                    d.remove(k)
            a.records.clear()
            b.records.clear()
            assert state(a) == state(b), step
        for seg in b.segments.values():
            seg.alloc.check()
    assert planned > 1000


def test_obj_and_pending_compare_by_identity() -> None:
    x = Obj(10, (), 0, None, "w")
    y = Obj(10, (), 0, None, "w")
    assert x != y and len({x, y}) == 2 and x.tick < y.tick and x.lease == 0.0
    p = Pending(10, (), 0, None, "c1", 1.0)
    assert p.pin == 0.0 and p.group is None and p != Pending(10, (), 0, None, "c1", 1.0)


def test_journal_batch_frames_and_legacy_record_frames(tmp_path: Path) -> None:
    j = Journal(str(tmp_path), 1, FsyncPolicy.NEVER)
    legacy = [3, "old", 10, 0, None, ["s1", 0]]
    with open(tmp_path / "journal-000000000001.log", "ab") as f:
        f.write(frame(msgspec.msgpack.encode(legacy)))  # one record per frame
    batch1 = [[3, f"k{i}", 10, 0, None, ["s1", 64 * i]] for i in range(5)]
    j.append_many(batch1)
    j.commit()
    # more than one frame's worth of records: several frames, still in order
    big = [[4, f"r{i}"] for i in range(10_000)]
    j.append_many(iter(big))
    j.commit()
    j.close()
    path = str(tmp_path / "journal-000000000001.log")
    records, torn = read_journal(path)
    assert not torn
    assert msgspec.to_builtins(records) == [legacy, *batch1, *big]
    # a torn batch frame drops that whole group commit, nothing before it
    size = (tmp_path / "journal-000000000001.log").stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 3)
    records, torn = read_journal(path)
    assert torn and msgspec.to_builtins(records[:6]) == [legacy, *batch1]
    assert len(records) < 6 + len(big)
    assert (len(records) - 6) % 4096 == 0  # whole frames only


def test_reserve_in_allocation_order_matches_allocate() -> None:
    """Replay (a standby, a restart) reserves what allocate() handed out, in
    order: the in-place path must leave the allocator as allocate() did."""
    rng = random.Random(7)
    a = Allocator(1 << 20, 64)
    b = Allocator(1 << 20, 64)
    live: list[tuple[int, int]] = []
    for _ in range(2000):
        if live and rng.random() < 0.35:
            off, size = live.pop(rng.randrange(len(live)))
            a.release(off, size)
            b.release(off, size)
        else:
            size = rng.choice([1, 64, 100, 4096, 9000])
            off = a.allocate(size)
            if off < 0:
                continue
            b.reserve(off, size)
            live.append((off, size))
        assert (b._starts, b._lens, b._by_size, b.used, b.free) == \
            (a._starts, a._lens, a._by_size, a.used, a.free)
    b.check()
    with pytest.raises(KVPoolError):
        b.reserve(live[0][0], live[0][1])  # not free


def test_allocate_run_matches_allocate_key_by_key() -> None:
    """allocate_run(size, count) hands out what ``count`` allocate() calls
    would (as far as the best-fit block holds), and giving its unused tail
    back leaves the free list as if only the used ranges were allocated."""
    rng = random.Random(11)
    a = Allocator(1 << 20, 64)
    b = Allocator(1 << 20, 64)
    live: list[tuple[int, int]] = []
    runs = 0
    for _ in range(1500):
        if live and rng.random() < 0.4:
            off, size = live.pop(rng.randrange(len(live)))
            a.release(off, size)
            b.release(off, size)
        else:
            size = rng.choice([1, 64, 100, 4096, 9000, 70_000])
            off, k = b.allocate_run(size, rng.randint(1, 24))
            used = rng.randint(1, k) if k else 0
            offs = [a.allocate(size) for _ in range(max(used, 1))]
            if not k:
                assert offs == [-1]
                continue
            need = b.aligned(size)
            assert offs == [off + m * need for m in range(used)]
            if used < k:
                b.release(off + used * need, (k - used) * need)
            live += [(o, size) for o in offs]
            runs += k > 1
        assert (b._starts, b._lens, b._by_size, b.used, b.free) == \
            (a._starts, a._lens, a._by_size, a.used, a.free)
    b.check()
    assert runs > 100


# ---------------------------------------------------------------- batched reads
MEM, FILE = SegmentKind.MEMORY, SegmentKind.FILE


def make_handlers(caps: bool = True) -> tuple[OpHandlers, Clock]:
    """A handler over a directory with memory and file segments (promotion on
    the first disk hit, small memory: promotions place and evict)."""
    clock = Clock()
    cfg = MasterConfig(eviction_high_watermark=0.9, eviction_ratio=0.2,
                       put_start_discard_timeout_s=5.0, max_key_length=MAX_KEY)
    policy = TieringPolicy(TieringConfig(promote_after_hits=1), clock=clock)
    d = Directory(cfg, clock=clock, hooks=policy)
    signer = CapabilitySigner(cfg.lease_ttl_ms)
    for sid, kind, size in (("m0", MEM, 1 << 20), ("m1", MEM, 1 << 20), ("m2", MEM, 1 << 20),
                            ("f0", FILE, 8 << 20)):
        d.mount("c1", SegmentDescriptor(
            sid, "c1", "h", kind, size, f"/disk/{sid}" if kind == FILE else f"kvpool-{sid}",
            base_offset=4096 if kind == FILE else 0,
            extra={"generation": 1} if kind == FILE else {}))
        signer.rotate(sid)
    d.records.clear()
    return OpHandlers(cfg, d, policy, signer if caps else None), clock


def per_key_get(h: OpHandlers, keys: list[str]) -> BatchGetReplicaListReply:
    """Key by key: get_replicas (a batch of one), the disk-hit hook and the
    reply of each key in turn."""
    d = h.dir
    segs: dict[str, SegmentDescriptor] = {}
    grants = h.reads.granter.grants(int(CapOp.READ))
    codes, sizes = [0] * len(keys), [0] * len(keys)
    out: list[list[ReplicaDescriptor]] = [[] for _ in keys]
    checksums: list[Any] = [None] * len(keys)
    for i, key in enumerate(keys):
        if not key or len(key) > MAX_KEY:
            codes[i] = int(ErrorCode.INVALID_KEY)
            continue
        code, val = d.get_replicas(key)
        if code:
            codes[i] = int(code)
            continue
        obj, reps = val
        sizes[i] = obj.size
        checksums[i] = obj.checksum
        if reps[0].kind is FILE:
            h.tiering.on_disk_hit(d, key, obj, reps)
        out[i] = replica_descriptors(reps, obj.size, ReplicaStatus.COMPLETE, segs, grants)
    return BatchGetReplicaListReply(
        codes, sizes, out, h.cfg.lease_ttl_ms,
        checksums if any(c is not None for c in checksums) else [], segs, grants.sign())


def reply_view(r: Any) -> dict[str, Any]:
    """A reply with each token as what it grants (nonce and expiry differ)."""
    out = {k: msgspec.to_builtins(v) for k, v in msgspec.structs.asdict(r).items()}
    out["segments"] = list(r.segments)  # their order too
    out["caps"] = [(c.segment_id, c.ranges, c.op) for c in map(cap_decode, r.caps)]
    return out


def read_state(h: OpHandlers) -> dict[str, Any]:
    d = h.dir
    out = state(d)
    out["leases"] = {k: o.lease for k, o in d.objects.items()}
    out["groups"] = dict(d.group_of)
    out["tasks"] = [(t.id, t.key, t.kind, t.src.id, t.src_off, t.dst.id, t.dst_off)
                    for t in h.tiering.tasks.values()]
    out["tier"] = dict(h.tiering.counters)
    out["records"] = list(d.records)
    return out


def populate(h: OpHandlers, rng: random.Random, names: list[str]) -> None:
    """The same random objects on every call with an equal ``rng``: one or two
    memory replicas, disk replicas, groups, checksums, puts left in flight."""
    d = h.dir
    for name in names:
        shape = rng.random()
        kw: dict[str, Any] = {}
        if shape < 0.2:
            kw = {"replica_num": 0, "disk_replica_num": 1}  # on disk only
        elif shape < 0.35:
            kw = {"replica_num": 2}
        elif shape < 0.45:
            kw = {"disk_replica_num": 1}  # memory + disk
        if rng.random() < 0.3:
            kw["group"] = f"g{rng.randrange(4)}"
        checksum = rng.choice([None, None, None, 12345])
        code, _ = d.put_start("c1", name, rng.choice([4096, 8192, 30_000]),
                              checksum=checksum, **kw)
        if not code and rng.random() < 0.85:
            assert d.put_end("c1", name) == 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_batch_get_replica_list_matches_per_key_path(seed: int) -> None:
    a, ca = make_handlers()
    b, cb = make_handlers()
    names = [f"key-{i:03d}" for i in range(120)]
    populate(a, random.Random(seed), names)
    populate(b, random.Random(seed), names)
    assert read_state(a) == read_state(b)
    rng = random.Random(seed * 7)
    for step in range(80):
        if step == 30:  # a segment's owner goes silent: its replicas are suspect
            for h in (a, b):
                h.dir.segtab.suspend(h.dir.segments["m1"])
        if step == 50:  # a segment is dropped: its replicas are dead until purged
            for h in (a, b):
                h.dir.drop_segment(h.dir.segments["m2"], "test")
        keys = [rng.choice(names) for _ in range(rng.randint(0, 40))]
        if keys and rng.random() < 0.2:
            keys[0] = ""
        if rng.random() < 0.2:
            keys.append("y" * (MAX_KEY + 1))
        if rng.random() < 0.2:
            keys.append("never-put")
        got_a = reply_view(per_key_get(a, keys))
        got_b = reply_view(b.reads.batch_get_replica_list(BatchGetReplicaList(keys)))
        assert got_a == got_b, step
        assert read_state(a) == read_state(b), step
        ca.t += rng.choice([0.0, 0.5, 3.0, 40.0])  # leases run out, groups renew
        cb.t = ca.t
        if rng.random() < 0.3:
            for h in (a, b):
                h.dir.evictor.step()
    # the unusual paths were exercised
    st = read_state(b)
    assert st["tier"].get("promote_started", 0) > 0
    assert b.dir.groups and b.dir.pending
    assert b.counters.key_ops["get_replica_list"] > 0


def test_get_replicas_many_stops_at_each_disk_hit() -> None:
    h, clock = make_handlers()
    d = h.dir
    for key, kw in (("m", {}), ("f", {"replica_num": 0, "disk_replica_num": 1}),
                    ("g1", {"group": "g"}), ("g2", {"group": "g"})):
        assert d.put_start("c1", key, 4096, **kw)[0] == 0 and d.put_end("c1", key) == 0
    keys = ["m", "f", "", "missing", "g1", "f"]
    n = len(keys)
    codes, objs, reps = [0] * n, [None] * n, [None] * n
    assert d.reads.get_replicas_many(keys, 0, codes, objs, reps) == 1
    assert d.reads.get_replicas_many(keys, 2, codes, objs, reps) == 5
    assert d.reads.get_replicas_many(keys, 6, codes, objs, reps) == n
    assert codes == [0, 0, int(ErrorCode.INVALID_KEY), int(ErrorCode.OBJECT_NOT_FOUND), 0, 0]
    assert objs[2] is None and objs[3] is None and reps[2] is None and reps[3] is None
    assert all(objs[i] is d.objects[keys[i]] for i in (0, 1, 4, 5))
    assert reps[1] == reps[5] == d.objects["f"].replicas and reps[1][0].kind == FILE
    lease = clock() + d.lease_s
    # a read of one member of a group leases every member
    assert d.objects["g2"].lease == lease == d.objects["g1"].lease == d.objects["m"].lease
    ticks = {k: d.objects[k].tick for k in ("m", "g1", "f")}
    assert ticks["m"] < ticks["g1"] < ticks["f"]  # use order: the LRU is exact


@pytest.mark.parametrize("caps", [True, False])
def test_single_key_replies_match_the_general_grant_path(caps: bool) -> None:
    """PUT_START and GET_REPLICA_LIST of one key sign their one replica
    directly: the reply is what replica_descriptors and Grants.sign make."""
    a, _ = make_handlers(caps)
    b, _ = make_handlers(caps)
    names = [f"key-{i:03d}" for i in range(60)]
    for h in (a, b):
        populate(h, random.Random(5), names)
    for key in [*names, "fresh-1", "fresh-2"]:
        if key in a.dir.pending:  # a put in flight
            assert key in b.dir.pending
            continue
        if key.startswith("key"):
            code_a, val_a = a.dir.get_replicas(key)
            try:
                got_b: Any = b.reads.get_replica_list(GetReplicaList(key))
            except KVPoolError as exc:
                assert exc.code == code_a != 0
                continue
            assert code_a == 0
            obj, reps = val_a
            if reps[0].kind is FILE:
                a.tiering.on_disk_hit(a.dir, key, obj, reps)
            segs: dict[str, SegmentDescriptor] = {}
            grants = a.reads.granter.grants(int(CapOp.READ))
            want: Any = GetReplicaListReply(
                obj.size, a.cfg.lease_ttl_ms,
                replica_descriptors(reps, obj.size, ReplicaStatus.COMPLETE, segs, grants),
                obj.checksum, segs, grants.sign())
        else:
            code, p = a.dir.put_start("c1", key, 4096)
            assert code == 0
            segs = {}
            grants = a.writes.granter.grants(int(CapOp.WRITE))
            want = PutStartReply(replica_descriptors(p.replicas, 4096, ReplicaStatus.PROCESSING,
                                             segs, grants), segs, grants.sign())
            got_b = b.writes.put_start(PutStart(client_id="c1", key=key, size=4096))
        assert reply_view(got_b) == reply_view(want), key
        assert bool(want.caps) == caps
    assert read_state(a) == read_state(b)
