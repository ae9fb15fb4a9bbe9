"""Unit: the one-pass batch paths of the directory (put_start_many,
put_end_many, exist_many) give exactly what the per-key methods give, and
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

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.allocator import Allocator
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory, Obj, Pending
from kvpool.master.journal import Journal, frame, read_journal

MAX_KEY = 64
MAX_SIZE = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(segments: int, seg_size: int) -> tuple[Directory, Clock]:
    clock = Clock()
    cfg = MasterConfig(eviction_high_watermark=0.9, eviction_ratio=0.2,
                       put_start_discard_timeout_s=5.0)
    d = Directory(cfg, clock=clock)
    for i in range(segments):
        d.mount("c1", SegmentDescriptor(f"s{i}", "c1", "h", SegmentKind.MEMORY, seg_size,
                                        f"kvpool-s{i}"))
    d.records.clear()
    return d, clock


def per_key_start(d: Directory, client: str, keys: list[str], sizes: list[int]
                  ) -> tuple[list[int], list[Any]]:
    """What batch_put_start did before put_start_many: validate, then put_start."""
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
    d.put_start_many(client, keys, sizes, MAX_KEY, MAX_SIZE, codes, out)
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
    segs = {s.id: (s.alloc.used, s.alloc.free, sorted(s.keys)) for s in d.segments.values()}
    return {"objects": objs, "lru": lru, "pending": pending, "segments": segs,
            "clients": dict(d.clients), "pool_used": dict(d.pool_used),
            "evictions": d.evictions, "preemptions": d.preemptions, "held": len(d._held)}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batch_paths_match_per_key_paths(seed: int) -> None:
    rng = random.Random(seed)
    # small segments: the pool fills, so eviction (the general path) runs too
    a, ca = make(4, 1 << 20)
    b, cb = make(4, 1 << 20)
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
        # end most of them (some by another client, some twice), leave some in flight
        ends = [k for k in keys if rng.random() < 0.8] + [rng.choice(names)]
        end_client = client if rng.random() < 0.85 else "c3"
        assert per_key_end(a, end_client, ends) == b.put_end_many(end_client, ends, MAX_KEY)
        assert a.records == b.records, step
        a.records.clear()
        b.records.clear()
        probe = [rng.choice(names) for _ in range(20)] + ["", "y" * (MAX_KEY + 1)]
        found_a = [a.exist(k) if k and len(k) <= MAX_KEY else False for k in probe]
        codes_b, found_b = b.exist_many(probe, MAX_KEY)
        assert found_a == found_b
        assert codes_b == [0 if k and len(k) <= MAX_KEY else int(ErrorCode.INVALID_KEY)
                           for k in probe]
        assert state(a) == state(b), step
        # time passes: in-flight puts of the past become preemptible
        ca.t += rng.choice([0.0, 1.0, 6.0])
        cb.t = ca.t
    assert a.evictions > 0 and a.preemptions > 0  # the general paths were exercised


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
    assert records == [legacy, *batch1, *big]
    # a torn batch frame drops that whole group commit, nothing before it
    size = (tmp_path / "journal-000000000001.log").stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 3)
    records, torn = read_journal(path)
    assert torn and records[:6] == [legacy, *batch1] and len(records) < 6 + len(big)
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
