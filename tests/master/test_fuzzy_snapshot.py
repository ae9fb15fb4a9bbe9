"""Unit: a fuzzy snapshot taken while the state keeps changing, plus the
journal written meanwhile, restores exactly the live state (real files)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory, SegState
from kvpool.master.journal import (
    Journal,
    SnapshotWriter,
    iter_snapshot,
    read_journal,
    read_snapshot,
)


def state(d: Directory) -> dict[str, Any]:
    objs = {}
    for k, o in d.objects.items():
        reps = [(o.replicas[i].id, o.replicas[i + 1]) for i in range(0, len(o.replicas), 2)
                if o.replicas[i].state != SegState.DEAD]
        if reps:
            objs[k] = (o.size, o.flags, sorted(reps))
    segs = {s.id: s.alloc.used for s in d.segments.values()}
    return {"objects": objs, "segments": segs}


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_fuzzy_snapshot_plus_journal_restores_exact_state(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    cfg = MasterConfig(eviction_high_watermark=0.95, eviction_ratio=0.1, purge_slice=50)
    d = Directory(cfg)
    data = str(tmp_path)
    journal = Journal(data, 1, FsyncPolicy.NEVER)

    def flush() -> None:
        journal.append_many(d.records)
        d.records.clear()
        journal.commit()

    def mount(sid: str, client: str) -> None:
        d.mount(client, SegmentDescriptor(sid, client, "h", SegmentKind.MEMORY, 64 * 4000,
                                          f"kvpool-{sid}"))

    for i in range(4):
        mount(f"s{i}", f"c{i}")
    n = 0

    def mutate(steps: int) -> None:
        nonlocal n
        for _ in range(steps):
            r = rng.random()
            if r < 0.6:
                # re-using old keys makes the snapshot capture a key before
                # its removal and again after a re-put elsewhere (conflicts)
                key = f"k{rng.randrange(n + 1)}" if rng.random() < 0.5 else f"k{n}"
                n += 1
                code, _ = d.put_start("w", key, rng.randint(1, 300), replica_num=rng.randint(1, 2))
                if code == 0:
                    d.put_end("w", key)
            elif r < 0.9 and d.objects:
                d.remove(rng.choice(list(d.objects)), force=True)
            elif r < 0.93 and len(d.segments) > 1:
                seg = d.segments[rng.choice(sorted(d.segments))]
                d.drop_segment(seg, "test")
            elif r < 0.96:
                mount(f"m{n}", f"c{n}")
                n += 1
            d.purge_step(20)
        flush()

    mutate(3000)
    # snapshot: rotate, then serialize slices while mutating in between
    old = journal.rotate(2, sync=False)
    snap = SnapshotWriter(data, 2, d.segtab.wires(), d.objects.key_chunks(), old)
    while not snap.step(d.replay.snapshot_chunk, budget_s=0.0, chunk=10):
        mutate(40)
    snap.done.wait(10)
    assert snap.error is None
    mutate(500)
    while d.objects.purge_pending:
        d.purge_step(1000)
    journal.close()
    expected = state(d)

    r = Directory(cfg)
    r.journaling = False
    header, snap_records = iter_snapshot(snap.final)
    r.replay.bulk_load(header["segments"], snap_records)  # what the server's restore does
    records, torn = read_journal(str(tmp_path / "journal-000000000002.log"))
    assert not torn and records
    for rec in records:
        r.apply_record(rec)
    r.finish_restore()
    assert state(r) == expected
    for seg in r.segments.values():
        seg.alloc.check()


def test_fuzzy_snapshot_overlapping_capture_is_fixed_by_replay(tmp_path: Path) -> None:
    """The snapshot captures "a" at offset 0, then "a" and "b" are removed and
    "b" is re-put at offset 0 before "b" is captured: the snapshot holds two
    objects on the same range. Loading drops the overlap; the journal fixes it."""
    d = Directory(MasterConfig(), shard_bits=0)  # one shard: keys captured in put order
    data = str(tmp_path)
    journal = Journal(data, 1, FsyncPolicy.NEVER)
    d.mount("c", SegmentDescriptor("s", "c", "h", SegmentKind.MEMORY, 64 * 4, "kvpool-s"))
    for k in ("a", "b"):
        d.put_start("w", k, 64)
        d.put_end("w", k)
    journal.append_many(d.records)
    d.records.clear()
    old = journal.rotate(2, sync=False)
    snap = SnapshotWriter(data, 2, d.segtab.wires(), d.objects.key_chunks(), old)
    assert not snap.step(d.replay.snapshot_chunk, budget_s=0.0, chunk=1)  # captures a@0
    d.remove("a")
    d.remove("b")
    code, p = d.put_start("w", "b", 64)
    assert code == 0 and p.replicas[1] == 0  # b re-put at offset 0
    d.put_end("w", "b")
    journal.append_many(d.records)
    d.records.clear()
    assert snap.step(d.replay.snapshot_chunk, budget_s=0.0, chunk=1)  # captures b@0
    snap.done.wait(10)
    journal.close()
    raw = read_snapshot(snap.final)
    assert sorted((o[0], o[4][1]) for o in raw.objects) == [("a", 0), ("b", 0)]
    r = Directory(MasterConfig())
    r.journaling = False
    header, recs = iter_snapshot(snap.final)
    r.replay.bulk_load(header["segments"], recs)
    assert set(r.objects) == {"a"}  # the overlapping "b" was dropped on load
    records, _ = read_journal(str(tmp_path / "journal-000000000002.log"))
    for rec in records:
        r.apply_record(rec)
    r.finish_restore()
    assert state(r) == state(d) == {"objects": {"b": (64, 0, [("s", 0)])}, "segments": {"s": 64}}
