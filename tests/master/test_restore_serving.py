"""Unit (real files): a restarted master serves before its snapshot's
objects are made (kvpool.master.unloaded).

The same data dir (a snapshot, then journal records written after it) is
restored twice: once loaded wholly at once, once left to load lazily. The
same random operations (batch lookups, exists, sizes, puts new and
existing, removes, listing pages), interleaved with background load steps
on the lazy side, must give the same answers on both; at the end both
directories are equal (objects, replicas, allocators, segment key sets,
tenants' usage). Eviction while loading takes objects never used since the
restart, not the ones read since. A real master restarted after kill -9
serves while loading and loses nothing when killed again meanwhile."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.protocol import (
    KEY_MIN,
    BatchExist,
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    ListObjects,
    MountSegment,
    Ping,
    Remove,
    SegmentDescriptor,
    SegmentKind,
    Stats,
)
from kvpool.core.tenants import scope_prefix
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.durability import Durability
from kvpool.master.events import list_objects
from kvpool.master.unloaded import Unloaded
from support.directory import restored_state
from support.factories import segment_desc

_MEM = SegmentKind.MEMORY


def _cfg(data: Path, **kw: Any) -> MasterConfig:
    return MasterConfig(data_dir=str(data), journal_fsync=FsyncPolicy.NEVER,
                        snapshot_interval_s=0, snapshot_journal_records=0, **kw)


def _put(d: Directory, key: str, size: int, **kw: Any) -> int:
    key_min = scope_prefix(key[1:key.index("\x1f", 1)]) + KEY_MIN if key < " " else KEY_MIN
    codes, placed = [0], [None]
    d.writes.put_start_many("w", [key], [size], codes, placed, key_min=key_min, max_key=1000)
    if codes[0]:
        return codes[0]
    return d.writes.commit_many("w", [key], None, key_min, 1000)[0]


def _tenant_key(n: int) -> str:
    return f"{scope_prefix(f't{n % 3}')}k{n}"


def build(data: Path, n: int, seed: int, capacity: int = 1 << 26, after: int = 12) -> None:
    """A data dir: ``n`` puts of several shapes (two replicas, flags,
    checksums, tenants' keys) with removes, a snapshot, then ``3 * after``
    journal records after it that replace, remove and add objects (each
    forces its key's shard at the restore: a few, to leave most unloaded)."""
    rng = random.Random(seed)
    cfg = _cfg(data, eviction_high_watermark=0.99)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    for i in range(3):
        d.mount(f"c{i}", SegmentDescriptor(f"s{i}", f"c{i}", "h", _MEM, capacity, f"kvpool-s{i}"))
    d.mount("c3", SegmentDescriptor("s3", "c3", "h", SegmentKind.FILE, capacity, "f3"))
    dur.commit(d.records)
    keys: list[str] = []
    for i in range(n):
        if i % 5 == 0:
            key = _tenant_key(i)
            _put(d, key, rng.choice([64, 4096]))
        else:
            key = f"k{i}"
            code, _ = d.put_start("w", key, rng.choice([64, 100, 4096, 7000]),
                                  replica_num=1 if i % 7 else 2, flags=i % 3,
                                  checksum=None if i % 4 else i)
            if code == 0:
                d.put_end("w", key)
        keys.append(key)
        if i % 3 == 0:
            d.remove(rng.choice(keys), force=True)
        dur.commit(d.records)
    dur.request_snapshot()
    dur.tick(d, 0.0)
    while dur.busy:
        dur.tick(d, 0.0)
    assert dur.stats.snapshots == 1
    # after the snapshot: the journal's records (replay forces their shards)
    for i in range(after):
        key = rng.choice(keys)
        if i % 2:
            d.remove(key, force=True)
        else:
            d.put_start("w", key, 300, replace=True)
            d.put_end("w", key)
        d.put_start("w", f"late{i}", 500)
        d.put_end("w", f"late{i}")
        dur.commit(d.records)
    dur.close([])


def restore(data: Path, **kw: Any) -> tuple[Durability, Directory]:
    """The directory of ``data`` restored, its segments' owners back."""
    cfg = _cfg(data, **{"eviction_high_watermark": 0.99, **kw})
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    for seg in list(d.segments.values()):
        desc = seg.desc
        d.mount(seg.owner, SegmentDescriptor(desc.segment_id, seg.owner, desc.host_id, desc.kind,
                                             desc.size, desc.name))
    return dur, d


def _found(found: list[Any]) -> list[Any]:
    return [None if f is None else [(f[i].id, f[i + 1]) for i in range(0, len(f), 2)]
            for f in found]


def _op(d: Directory, rng: random.Random, keys: list[str], step: int) -> Any:
    """One random operation on ``d`` (``rng`` drives both sides alike)."""
    kind = rng.randrange(7)
    batch = [*rng.sample(keys, rng.randint(1, 6)), f"missing{step}"]
    if kind == 0:
        n = len(batch)
        codes, objs, found = [0] * n, [None] * n, [None] * n
        d.reads.get_replicas_many(batch, 0, codes, objs, found)
        return "get", codes, _found(found)
    if kind == 1:
        return "exist", d.reads.exist_many(batch)
    if kind == 2:
        return "sizes", d.reads.sizes_many(batch)
    if kind == 3:  # new keys and existing ones
        new = [f"new{step}-{j}" for j in range(3)] + batch[:2]
        codes, placed = [0] * len(new), [None] * len(new)
        d.writes.put_start_many("w", new, [rng.choice([64, 4096])] * len(new), codes, placed)
        ok = [k for k, c in zip(new, codes, strict=True) if not c]
        commits = d.writes.commit_many("w", ok)
        keys.extend(ok)
        return "put", codes, _found(placed), commits
    if kind == 4:
        return "remove", d.removal.remove_many(batch, True)
    if kind == 5:  # an upsert of one key
        key = batch[0]
        code, _ = d.put_start("w", key, 200, replace=True)
        return "upsert", code, d.put_end("w", key) if not code else None
    cursor = rng.randrange(d.objects.mask + 1)
    page = list_objects(d, ListObjects(cursor=cursor, limit=50), (0, 0, 0))
    return "list", sorted((o.key, o.size) for o in page.objects)


@pytest.fixture(params=[512, 4], ids=["buckets=shards", "buckets<shards"])
def bucket_objects(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Load buckets of the default size (at these object counts: one per
    shard) and of a few objects (several per shard, as at millions)."""
    monkeypatch.setattr(Unloaded, "BUCKET_OBJECTS", request.param)
    return int(request.param)


def test_a_lazily_loaded_restore_answers_as_a_loaded_one(tmp_path: Path,
                                                         bucket_objects: int) -> None:
    build(tmp_path / "orig", 6000, seed=1)
    for side in ("a", "b"):
        shutil.copytree(tmp_path / "orig", tmp_path / side)
    dur_a, a = restore(tmp_path / "a")
    dur_b, b = restore(tmp_path / "b")
    try:
        assert b.objects.unloaded is not None  # served before its objects are made
        assert (b.objects.unloaded.bmask > b.objects.mask) == (bucket_objects < 512)
        left = b.objects.unloaded.count
        # the journal's keys forced their shards, not more
        assert len(b.objects) * 0.7 < left < len(b.objects)
        a.objects.force_all()
        assert a.objects.unloaded is None
        assert len(a.objects) == len(b.objects)
        assert b.stats()["restore_unloaded"] == left
        # the tenants' usage (quotas act on it) is right before any object is made
        assert sorted((t.name, t.mem, t.disk, t.objects) for t in b.tenants.by_name.values()) \
            == sorted((t.name, t.mem, t.disk, t.objects) for t in a.tenants.by_name.values())
        keys = sorted(a.objects)
        keys_b = list(keys)
        rng_a, rng_b = random.Random(7), random.Random(7)
        while_loading = 0
        for step in range(400):
            got_a = _op(a, rng_a, keys, step)
            got_b = _op(b, rng_b, keys_b, step)
            assert got_a == got_b, f"step {step}"
            if b.objects.unloaded is not None:
                while_loading += 1
                if step % 10 == 0:
                    b.objects.load_step(0.0)  # one shard in the background
        assert while_loading > 100  # (the ops' keys load their shards as they go)
        assert restored_state(b) == restored_state(a)
        assert b.objects.unloaded is None
    finally:
        dur_a.close([])
        dur_b.close([])


def test_background_steps_load_everything_and_a_snapshot_loads_the_rest(
        tmp_path: Path) -> None:
    build(tmp_path / "orig", 3000, seed=2)
    shutil.copytree(tmp_path / "orig", tmp_path / "b")
    dur, b = restore(tmp_path / "b")
    try:
        assert b.objects.unloaded is not None
        steps = 0
        while b.objects.load_step(0.0):
            steps += 1
        assert b.objects.unloaded is None and steps > 10
        expected = restored_state(b)
    finally:
        dur.close([])
    # a snapshot taken while loading holds every object
    dur, b = restore(tmp_path / "b")
    try:
        assert b.objects.unloaded is not None
        dur.request_snapshot()
        dur.tick(b, 0.0)
        while dur.busy:
            dur.tick(b, 0.0)
        assert b.objects.unloaded is None
    finally:
        dur.close([])
    dur, again = restore(tmp_path / "b")
    try:
        assert restored_state(again) == expected
    finally:
        dur.close([])


def test_eviction_while_loading_takes_objects_not_used_since_the_restart(
        tmp_path: Path, bucket_objects: int) -> None:
    """A full pool restarted: puts evict at once. The objects read since the
    restart stay; the victims are objects not touched since it."""
    data = tmp_path / "d"
    cfg = _cfg(data, eviction_high_watermark=0.95)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg))
    d.mount("c", SegmentDescriptor("s", "c", "h", _MEM, 4096 * 1000, "kvpool-s"))
    for i in range(930):
        assert d.put_start("w", f"k{i}", 4096)[0] == 0
        d.put_end("w", f"k{i}")
    dur.commit(d.records)
    dur.request_snapshot()
    dur.tick(d, 0.0)
    while dur.busy:
        dur.tick(d, 0.0)
    dur.close([])
    dur, r = restore(data, eviction_high_watermark=0.95)
    try:
        assert r.objects.unloaded is not None
        hot = [f"k{i}" for i in range(0, 930, 31)]
        n = len(hot)
        codes = [0] * n
        r.reads.get_replicas_many(hot, 0, codes, [None] * n, [None] * n)
        assert codes == [0] * n
        now = r.clock()
        for obj in (r.objects.get(k) for k in hot):
            assert obj is not None
            obj.lease = now  # (read leases end: only use order protects them)
        for i in range(100):  # past the high watermark: each put evicts
            assert r.put_start("w", f"new{i}", 4096)[0] == 0
            assert r.put_end("w", f"new{i}") == 0
        assert r.evictor.evictions > 0
        assert all(k in r.objects for k in hot)
        r.segments["s"].alloc.check()
    finally:
        dur.close([])


def test_a_restarted_master_serves_while_loading_and_survives_kill9(tmp_path: Path) -> None:
    """A real master: killed after a snapshot, restarted, it answers while
    it makes the snapshot's objects (its log says so); writes and removes
    land meanwhile; killed again with -9 (while loading or just after) and
    restarted, every object is where it was, byte offsets included."""
    data = str(tmp_path / "d")
    n = 60_000
    keys = [f"key/{i:06d}" for i in range(n)]
    with MasterProcess(data_dir=data) as m:
        with m.client() as c:
            c.call(MountSegment(client_id="c1", segment=segment_desc("a", "c1", 64 << 20)))
            for base in range(0, n, 2000):
                batch = keys[base:base + 2000]
                assert not any(c.call(BatchPutStart("c1", batch, [100] * len(batch))).codes)
                c.call(BatchPutEnd(client_id="c1", keys=batch))
            sample = keys[::997]
            before = c.call(BatchGetReplicaList(keys=sample))
            assert m.pid is not None
            os.kill(m.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 30
            while c.call(Stats()).snapshots < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        m.kill()
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))  # the owner is back: its segment serves again
            assert c.call(Stats()).restored_objects == n
            late = [f"late/{i}" for i in range(50)]
            assert not any(c.call(BatchPutStart("c1", late, [100] * 50)).codes)
            c.call(BatchPutEnd(client_id="c1", keys=late))
            c.call(Remove(key=keys[7]))
            got = c.call(BatchGetReplicaList(keys=sample))
            assert got.codes == before.codes == [0] * len(sample)
            assert got.replicas == before.replicas
        assert "of them load" in Path(m.log_path).read_text()  # it served while loading
        m.kill()  # -9, perhaps before every object was made
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))
            assert c.call(Stats()).objects == n + 50 - 1
            for base in range(0, n, 5000):
                batch = keys[base:base + 5000]
                exists = c.call(BatchExist(keys=batch)).exists
                assert exists == [k != keys[7] for k in batch]
            assert all(c.call(BatchExist(keys=late)).exists)
            again = c.call(BatchGetReplicaList(keys=sample))
            assert again.replicas == before.replicas
