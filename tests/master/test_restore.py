"""Unit (real files): the restore path. A snapshot's column chunks load back
the exact directory (objects, replicas, allocators, segment key sets, tenant
usage) whatever the mix of objects, a version-1 snapshot loads the same, a
key written twice loads once, and the journal stays bounded by
size-triggered snapshots (compaction) however long the stream of changes."""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgpack

from kvpool.core.protocol import KEY_MIN, SegmentDescriptor, SegmentKind
from kvpool.core.tenants import scope_prefix, split_scoped
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.durability import Durability
from kvpool.master.journal import (
    CHUNK,
    SnapshotWriter,
    iter_snapshot,
    list_journals,
    list_snapshots,
    read_snapshot,
)
from support.directory import restored_state


def put_scoped(d: Directory, key: str, size: int) -> None:
    """A put of ``key`` in a tenant's namespace (below " ", as the handlers
    store it, checked against its scope's lower bound as they check it)."""
    codes, placed = [0], [None]
    key_min = scope_prefix(split_scoped(key)[0]) + KEY_MIN
    d.writes.put_start_many("w", [key], [size], codes, placed, key_min=key_min, max_key=1000)
    assert codes == [0]
    assert d.writes.commit_many("w", [key], None, key_min, 1000) == [0]


def mixed_directory(seed: int) -> Directory:
    """Objects of several sizes on four segments (memory and file), some with
    two replicas, flags and checksums, tenants' keys, holes left by removes."""
    rng = random.Random(seed)
    d = Directory(MasterConfig(eviction_high_watermark=0.99))
    for i, kind in enumerate([SegmentKind.MEMORY] * 3 + [SegmentKind.FILE]):
        d.mount(f"c{i}", SegmentDescriptor(f"s{i}", f"c{i}", "h", kind, 1 << 24, f"kvpool-s{i}"))
    for n in range(3000):
        if n % 5 == 0:
            put_scoped(d, f"{scope_prefix(f't{n % 3}')}k{n}", rng.choice([64, 4096]))
            continue
        key = f"k{n}"
        code, _ = d.put_start("w", key, rng.choice([64, 100, 4096, 7000]),
                              replica_num=1 if n % 7 else 2, flags=n % 3,
                              checksum=None if n % 4 else n)
        if code == 0:
            assert d.put_end("w", key) == 0
        if n % 3 == 0 and d.objects:
            d.remove(rng.choice(list(d.objects)), force=True)
    d.records.clear()
    return d


def snapshot(d: Directory, data: str, chunk: int) -> str:
    snap = SnapshotWriter(data, 2, d.segtab.wires(), d.objects.key_chunks())
    while not snap.step(d.replay.snapshot_chunk, budget_s=0.0, chunk=chunk):
        pass
    snap.done.wait(10)
    assert snap.error is None
    return snap.final


def load(path: str) -> Directory:
    r = Directory(MasterConfig(eviction_high_watermark=0.99))
    r.journaling = False
    header, items = iter_snapshot(path)
    assert r.replay.bulk_load(header["segments"], items) == len(r.objects)
    r.finish_restore()
    for seg in r.segments.values():
        seg.alloc.check()
    return r


def test_column_snapshot_restores_the_exact_directory(tmp_path: Path) -> None:
    d = mixed_directory(1)
    assert any(len(o.replicas) == 4 for _, o in d.objects.items())  # two replicas
    d.finish_restore()  # the tenants' usage as a restore computes it, to compare
    assert len(restored_state(d)["tenants"]) >= 3  # t0, t1, t2 (and the default)
    path = snapshot(d, str(tmp_path), chunk=97)
    with open(path, "rb") as f:
        items = list(msgpack.Unpacker(f, raw=False))
    assert items[0]["version"] == 2 and all(i[0] == CHUNK for i in items[1:-1])
    assert any(i[2] for i in items[1:-1])  # two-replica objects travel as records
    r = load(path)
    assert restored_state(r) == restored_state(d)
    assert len(r.objects) == len(read_snapshot(path).objects)


def test_version1_snapshot_still_loads(tmp_path: Path) -> None:
    d = mixed_directory(2)
    d.finish_restore()
    path = str(tmp_path / "snapshot-000000000002.msgpack")
    recs = [d.replay.snapshot_record(k) for k in d.objects]
    with open(path, "wb") as f:
        f.write(msgpack.packb({"version": 1, "seq": 2, "segments": d.segtab.wires()}))
        for rec in recs:
            f.write(msgpack.packb(rec))
        f.write(msgpack.packb(["__end__", len(recs)]))
    assert restored_state(load(path)) == restored_state(d)


def test_a_key_twice_loads_once_with_consistent_allocators(tmp_path: Path) -> None:
    """A snapshot naming a key in two chunks (not one a master writes): one
    copy is kept, and the space of the other is not held."""
    d = Directory(MasterConfig())
    d.mount("c", SegmentDescriptor("s", "c", "h", SegmentKind.MEMORY, 1 << 20, "kvpool-s"))
    path = str(tmp_path / "snapshot-000000000002.msgpack")
    with open(path, "wb") as f:
        f.write(msgpack.packb({"version": 2, "seq": 2, "segments": d.segtab.wires()}))
        f.write(msgpack.packb([CHUNK, [["s", ["a", "b"], [64, 64], [0, 0], [None, None],
                                        [0, 64]]], []]))
        f.write(msgpack.packb([CHUNK, [["s", ["a"], [64], [0], [None], [128]]], []]))
        f.write(msgpack.packb(["__end__", 3]))
    r = load(path)
    assert sorted(r.objects) == ["a", "b"]
    assert r.segments["s"].alloc.used == 128 and sorted(r.segments["s"].keys) == ["a", "b"]


def test_journal_stays_bounded_by_size_triggered_snapshots(tmp_path: Path) -> None:
    """Puts and removes stream on with no timed snapshot: snapshots taken
    once the journal holds ``snapshot_journal_records`` records keep the
    files bounded through many compactions, and the restore is exact."""
    data = str(tmp_path / "d")
    cfg = MasterConfig(data_dir=data, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0,
                       snapshot_journal_records=500, snapshot_keep=2)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    d.mount("c", SegmentDescriptor("s", "c", "h", SegmentKind.MEMORY, 1 << 26, "kvpool-s"))
    dur.commit(d.records)
    sizes = []
    for n in range(12000):
        d.put_start("w", f"k{n}", 100)
        d.put_end("w", f"k{n}")
        if n >= 200:  # 200 live objects
            d.remove(f"k{n - 200}", force=True)
        dur.commit(d.records)
        dur.tick(d, 0.0)
        while dur.busy:  # the writer thread's fsyncs: slower than this loop's puts
            dur.tick(d, 0.0)
        if n % 1000 == 999:
            sizes.append(sum(os.path.getsize(p) for _, p in list_journals(data)))
            # the kept ones, plus one written but not yet compacted (the next tick)
            assert len(list_snapshots(data)) <= 3 and len(list_journals(data)) <= 4
    assert dur.stats.snapshots >= 40  # a compaction every 500 records
    # the journal after the oldest kept snapshot: a few snapshots' worth, never growing
    assert max(sizes) < 3 * 500 * 40 and max(sizes[-4:]) <= 2 * max(sizes[:4])
    while dur.busy:  # a snapshot still being written: finish it
        dur.tick(d, 0.0)
    expected = restored_state(d)
    dur.close([])
    again = Durability(cfg)
    r = again.restore(lambda: Directory(cfg))
    assert restored_state(r) == expected
    again.close([])


def test_restart_after_a_long_replay_compacts_at_once(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    cfg = MasterConfig(data_dir=data, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0,
                       snapshot_journal_records=0)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    d.mount("c", SegmentDescriptor("s", "c", "h", SegmentKind.MEMORY, 1 << 26, "kvpool-s"))
    for n in range(1000):
        d.put_start("w", f"k{n}", 100)
        d.put_end("w", f"k{n}")
        d.remove(f"k{n}", force=True)
        dur.commit(d.records)
    dur.close([])
    cfg2 = MasterConfig(data_dir=data, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0,
                        snapshot_journal_records=1000)
    again = Durability(cfg2)
    r = again.restore(lambda: Directory(cfg2))
    again.tick(r, 0.0)  # the first tick starts the snapshot the long replay asked for
    while again.busy:
        again.tick(r, 0.0)
    assert again.stats.snapshots == 1
    assert again.journal is not None
    assert [s for s, _ in list_journals(data)] == [again.journal.seq]
    again.close([])


def test_journal_replay_counts_the_tenants_usage(tmp_path: Path) -> None:
    """Tenants' keys restored from the journal alone (the inline replay of new
    objects) are counted as the live directory counted them."""
    data = str(tmp_path / "d")
    cfg = MasterConfig(data_dir=data, journal_fsync=FsyncPolicy.NEVER, snapshot_interval_s=0)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    d.mount("c", SegmentDescriptor("s", "c", "h", SegmentKind.MEMORY, 1 << 26, "kvpool-s"))
    for n in range(300):
        if n % 3:
            put_scoped(d, f"{scope_prefix(f't{n % 2}')}k{n}", 100 + n)
        else:
            assert d.put_start("w", f"k{n}", 100 + n)[0] == 0 and d.put_end("w", f"k{n}") == 0
        dur.commit(d.records)
    live = restored_state(d)["tenants"]
    assert [t[3] for t in live] == [100, 100]  # t0 and t1: 100 objects each
    dur.close([])
    again = Durability(cfg)
    r = again.restore(lambda: Directory(cfg))
    assert restored_state(r)["tenants"] == live
    again.close([])
