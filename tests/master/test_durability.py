"""Integration: journal + snapshots survive kill -9; torn/corrupt journals;
owners re-adopting their segments after a restart."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    BatchExist,
    BatchGetReplicaList,
    BatchPutEnd,
    BatchPutStart,
    Exist,
    GetReplicaList,
    ListSegments,
    MountSegment,
    Ping,
    PingReply,
    PutEnd,
    PutOptions,
    PutStart,
    Remove,
    SegmentKind,
    Stats,
    StatsReply,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.master.journal import list_journals, list_snapshots
from support.factories import segment_desc


def mount(c: MasterClient, sid: str, client_id: str = "c1", size: int = 64 << 20,
          kind: SegmentKind = SegmentKind.MEMORY) -> None:
    c.call(MountSegment(client_id=client_id, segment=segment_desc(sid, client_id, size, kind)))


def wait_stats(c: MasterClient, pred: Any, timeout: float = 10.0) -> StatsReply:
    deadline = time.monotonic() + timeout
    while True:
        st = c.call(Stats())
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_kill9_mid_workload_restores_every_committed_object(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data) as m:
        # segments far larger than the workload can fill: an eviction (a
        # legitimate DROP_REPLICA under pressure) would change replica sets
        # the test compares exactly
        with m.client() as c:
            mount(c, "a", size=1 << 34)
            mount(c, "b", size=1 << 34)
            mount(c, "f", size=1 << 34, kind=SegmentKind.FILE)
        committed: dict[str, list[Any]] = {}
        removed: set[str] = set()
        # a REMOVE whose reply never came: the master may have applied and
        # journaled it just before it died, or not; either outcome is right
        unsure: set[str] = set()
        stop = threading.Event()

        def writer(wid: int) -> None:
            with MasterClient(m.address, timeout_s=2) as wc:
                i = 0
                while not stop.is_set():
                    keys = [f"w{wid}-{i + j}" for j in range(16)]
                    sizes = [1000 + j for j in range(len(keys))]
                    # alternate batches with and without a disk replica
                    opts = PutOptions(replica_num=2, disk_replica_num=(i // 16) % 2)
                    try:
                        r = wc.call(BatchPutStart("c1", keys, sizes, opts))
                        wc.call(BatchPutEnd(client_id="c1", keys=keys))
                        for k, code, reps in zip(keys, r.codes, r.replicas, strict=True):
                            assert code == 0
                            committed[k] = sorted((x.segment_id, x.offset) for x in reps)
                        unsure.add(keys[0])
                        wc.call(Remove(key=keys[0]))
                        removed.add(keys[0])
                        unsure.discard(keys[0])
                    except MasterRPCError:
                        return  # the master died under us
                    i += 16

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.8)
        m.kill()  # SIGKILL mid-workload
        stop.set()
        for t in threads:
            t.join(10)
        assert len(committed) > 100
        m.start()
        with m.client() as c:
            st = c.call(Stats())
            live = {k: v for k, v in committed.items() if k not in removed and k not in unsure}
            # unacknowledged puts may also be there; every acknowledged one must be
            assert st.restored_objects >= len(live)
            # before the owner is back, replicas are not readable
            k0 = next(iter(live))
            with pytest.raises(MasterRPCError) as ei:
                c.call(GetReplicaList(key=k0))
            assert ei.value.code == ErrorCode.REPLICA_IS_NOT_READY
            # the owner pings: its segments are adopted again, same locations
            assert c.call(Ping(client_id="c1")) == PingReply(remount=False,
                                                             segment_ids=["a", "b", "f"])
            keys = list(live)
            for base in range(0, len(keys), 4096):
                chunk = keys[base:base + 4096]
                res = c.call(BatchGetReplicaList(keys=chunk))
                for k, code, reps in zip(chunk, res.codes, res.replicas, strict=True):
                    assert code == 0, k
                    assert sorted((x.segment_id, x.offset) for x in reps) == live[k]
            gone_keys = sorted(removed)
            for base in range(0, len(gone_keys), 4096):
                gone = c.call(BatchExist(keys=gone_keys[base:base + 4096]))
                assert not any(gone.codes) and not any(gone.exists)
            # an unacknowledged remove: either gone, or there with every replica
            for k in unsure & committed.keys():
                try:
                    got = c.call(GetReplicaList(key=k))
                except MasterRPCError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND, k
                else:
                    assert sorted((x.segment_id, x.offset) for x in got.replicas) == committed[k], k
            # allocator state was rebuilt: new puts never overlap restored replicas
            used = {(x[0], x[1]) for v in live.values() for x in v}
            r = c.call(BatchPutStart("c1", [f"new{i}" for i in range(50)], [1000] * 50))
            for code, reps in zip(r.codes, r.replicas, strict=True):
                assert code == 0 and (reps[0].segment_id, reps[0].offset) not in used


def test_snapshot_compacts_journal_and_restores(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data, extra_args=["--snapshot-keep", "1"]) as m:
        with m.client() as c:
            mount(c, "a")
            n = 3000
            for base in range(0, n, 500):
                keys = [f"k{i}" for i in range(base, base + 500)]
                c.call(BatchPutStart("c1", keys, [100] * len(keys)))
                c.call(BatchPutEnd(client_id="c1", keys=keys))
            assert m.pid is not None
            os.kill(m.pid, signal.SIGUSR1)
            st = wait_stats(c, lambda s: s.snapshots >= 1)
            assert st.snapshots == 1 and st.last_snapshot_pause_ms < 1000
            # after the snapshot: more changes land in the new journal
            c.call(Remove(key="k0"))
            c.call(PutStart(client_id="c1", key="after", size=100))
            c.call(PutEnd(client_id="c1", key="after"))
            os.kill(m.pid, signal.SIGUSR1)
            wait_stats(c, lambda s: s.snapshots >= 2)
            c.call(Remove(key="k1"))
        snaps = list_snapshots(data)
        assert len(snaps) == 1  # keep 1
        assert [s for s, _ in list_journals(data)] == [snaps[0][0]]  # older journals compacted
        m.kill()
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))
            st = c.call(Stats())
            assert st.objects == n - 2 + 1
            ex = c.call(BatchExist(keys=["k0", "k1", "k2", "after", f"k{n - 1}"]))
            assert ex.exists == [False, False, True, True, True]


def test_torn_and_corrupt_journal_tail_truncated(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data) as m:
        with m.client() as c:
            mount(c, "a")
            for i in range(20):
                c.call(PutStart(client_id="c1", key=f"k{i}", size=10))
                c.call(PutEnd(client_id="c1", key=f"k{i}"))
        m.kill()
        (_seq, path), = [j for j in list_journals(data) if os.path.getsize(j[1])]
        size = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(b"\x40\x00\x00\x00\x12\x34")  # torn header of a 64-byte record
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))
            assert c.call(Stats()).objects == 20
        m.stop()
        assert os.path.getsize(path) == size  # the torn tail was cut off
        # flip a byte inside the last record: CRC mismatch -> that record is dropped
        with open(path, "r+b") as f:
            f.seek(size - 3)
            b = f.read(1)
            f.seek(size - 3)
            f.write(bytes([b[0] ^ 0xFF]))
        # and garbage in a newer journal file too
        with open(os.path.join(data, "journal-999999999999.log"), "wb") as f:
            f.write(os.urandom(1000))
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))
            ex = c.call(BatchExist(keys=[f"k{i}" for i in range(20)]))
            assert ex.exists == [True] * 19 + [False]
            c.call(PutStart(client_id="c1", key="new", size=10))
            c.call(PutEnd(client_id="c1", key="new"))
            assert c.call(Exist(key="new")).exists


def test_owner_that_never_returns_is_dropped_and_remount_readopts(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data, client_ttl_s=1.0,
                       extra_args=["--client-grace-s", "0.5"]) as m:
        with m.client() as c:
            mount(c, "gone", client_id="c-gone")
            mount(c, "back", client_id="c-back")
            for sid in ("gone", "back"):
                c.call(PutStart(client_id="w", key=f"on-{sid}", size=10,
                                options=PutOptions(preferred_segments=[sid])))
                c.call(PutEnd(client_id="w", key=f"on-{sid}"))
        assert m.stop() == 0  # SIGTERM: clean shutdown, exit code 0
        m.start()
        with m.client() as c:
            # a restarted owner process (new client id) mounts the same segment id
            desc = segment_desc("back", "c-back-2", 64 << 20)
            c.call(MountSegment(client_id="c-back-2", segment=desc))
            g = c.call(GetReplicaList(key="on-back"))
            assert g.replicas[0].segment_id == "back"
            assert g.segments["back"].client_id == "c-back-2"
            mismatch = segment_desc("gone", "x", 1 << 20)  # different size: refused
            with pytest.raises(MasterRPCError) as ei:
                c.call(MountSegment(client_id="x", segment=mismatch))
            assert ei.value.code == ErrorCode.SEGMENT_MISMATCH
            # c-back-2 keeps pinging; "gone"'s owner never returns within ttl + grace
            st = wait_stats(c, lambda s: c.call(Ping(client_id="c-back-2"))
                            and s.segments == 1, timeout=5)
            assert st.segments == 1
            assert [s.descriptor.segment_id for s in c.call(ListSegments()).segments] == ["back"]
            assert not c.call(Exist(key="on-gone")).exists
            assert c.call(Exist(key="on-back")).exists


def test_torn_newest_snapshot_falls_back_to_older_one(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data, extra_args=["--snapshot-keep", "2"]) as m:
        with m.client() as c:
            mount(c, "a")
            assert m.pid is not None
            for round_ in range(2):
                keys = [f"r{round_}-{i}" for i in range(300)]
                c.call(BatchPutStart("c1", keys, [100] * len(keys)))
                c.call(BatchPutEnd(client_id="c1", keys=keys))
                os.kill(m.pid, signal.SIGUSR1)
                wait_stats(c, lambda s, r=round_: s.snapshots >= r + 1)
            c.call(PutStart(client_id="c1", key="last", size=100))
            c.call(PutEnd(client_id="c1", key="last"))
        m.kill()
        snaps = list_snapshots(data)
        assert len(snaps) == 2
        newest = snaps[-1][1]
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) // 2)
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))
            st = c.call(Stats())
            assert st.objects == 601
            assert "ignoring snapshot" in m.log_tail(20000)
            ex = c.call(BatchExist(keys=["r0-0", "r1-299", "last"]))
            assert ex.codes == [0] * 3 and all(ex.exists)


@pytest.mark.parametrize("policy", ["always", "never"])
def test_fsync_policies_survive_kill9(tmp_path: Path, policy: str) -> None:
    with MasterProcess(data_dir=str(tmp_path / "d"), extra_args=["--journal-fsync", policy]) as m:
        with m.client() as c:
            mount(c, "a")
            keys = [f"k{i}" for i in range(50)]
            c.call(BatchPutStart("c1", keys, [10] * len(keys)))
            c.call(BatchPutEnd(client_id="c1", keys=keys))
        m.kill()
        m.start()
        with m.client() as c:
            c.call(Ping(client_id="c1"))
            ex = c.call(BatchExist(keys=keys))
            assert ex.codes == [0] * len(keys) and all(ex.exists)
