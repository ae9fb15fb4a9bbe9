"""Unit: a fuzzy snapshot taken while the state keeps changing, plus the
journal written meanwhile, restores exactly the live state (real files)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory, SegState
from kvpool.master.journal import Journal, SnapshotWriter, read_journal, read_snapshot
from kvpool.master.protocol import SegmentDescriptor, SegmentKind


def state(d: Directory) -> dict[str, Any]:
    objs = {}
    for k, o in d.objects.items():
        reps = [(o.replicas[i].id, o.replicas[i + 1]) for i in range(0, len(o.replicas), 2)
                if o.replicas[i].state != SegState.DEAD]
        if reps:
            objs[k] = (o.size, o.flags, sorted(reps))
    segs = {s.id: s.alloc.used for s in d.segments.values()}
    return {"objects": objs, "segments": segs}


def test_fuzzy_snapshot_plus_journal_restores_exact_state(tmp_path: Path) -> None:
    rng = random.Random(5)
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
                key = f"k{n}"
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
    snap = SnapshotWriter(data, 2, d.segment_wires(), list(d.objects), old)
    while not snap.step(d.snapshot_record, budget_s=0.0, chunk=50):
        mutate(15)
    snap.done.wait(10)
    assert snap.error is None
    mutate(500)
    while d.purge_pending:
        d.purge_step(1000)
    journal.close()
    expected = state(d)

    r = Directory(cfg)
    r.journaling = False
    s = read_snapshot(snap.final)
    for wire in s.segments:
        r.restore_segment(wire)
    for key, size, flags, checksum, reps in s.objects:
        r.restore_object(key, size, flags, checksum, reps)
    records, torn = read_journal(str(tmp_path / "journal-000000000002.log"))
    assert not torn and records
    for rec in records:
        r.apply_record(rec)
    r.finish_restore()
    assert state(r) == expected
    for seg in r.segments.values():
        seg.alloc.check()
