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
from kvpool.core.protocol import Op, SegmentKind
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from kvpool.master.journal import list_journals, list_snapshots
from support.factories import segment_wire


def mount(c: MasterClient, sid: str, client_id: str = "c1", size: int = 64 << 20,
          kind: SegmentKind = SegmentKind.MEMORY) -> None:
    c.call(Op.MOUNT_SEGMENT, client_id=client_id, segment=segment_wire(sid, client_id, size, kind))


def wait_stats(c: MasterClient, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = c.call(Op.STATS)
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_kill9_mid_workload_restores_every_committed_object(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data) as m:
        with m.client() as c:
            mount(c, "a")
            mount(c, "b")
            mount(c, "f", kind=SegmentKind.FILE)
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
                    items = [{"key": k, "size": 1000 + j, "replica_num": 2,
                              "disk_replica_num": j % 2} for j, k in enumerate(keys)]
                    try:
                        r = wc.call(Op.BATCH_PUT_START, client_id="c1", items=items)["results"]
                        wc.call(Op.BATCH_PUT_END, client_id="c1", keys=keys)
                        for k, (code, reps) in zip(keys, r, strict=True):
                            assert code == 0
                            committed[k] = sorted((x[0], x[1]) for x in reps)
                        unsure.add(keys[0])
                        wc.call(Op.REMOVE, key=keys[0])
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
            st = c.call(Op.STATS)
            live = {k: v for k, v in committed.items() if k not in removed and k not in unsure}
            # unacknowledged puts may also be there; every acknowledged one must be
            assert st["restored_objects"] >= len(live)
            # before the owner is back, replicas are not readable
            k0 = next(iter(live))
            with pytest.raises(MasterRPCError) as ei:
                c.call(Op.GET_REPLICA_LIST, key=k0)
            assert ei.value.code == ErrorCode.REPLICA_IS_NOT_READY
            # the owner pings: its segments are adopted again, same locations
            assert c.call(Op.PING, client_id="c1") == {"remount": False,
                                                       "segment_ids": ["a", "b", "f"]}
            keys = list(live)
            for base in range(0, len(keys), 4096):
                chunk = keys[base:base + 4096]
                res = c.call(Op.BATCH_GET_REPLICA_LIST, keys=chunk)["results"]
                for k, (code, val) in zip(chunk, res, strict=True):
                    assert code == 0, k
                    assert sorted((x[0], x[1]) for x in val["replicas"]) == live[k]
            gone_keys = sorted(removed)
            for base in range(0, len(gone_keys), 4096):
                gone = c.call(Op.BATCH_EXIST, keys=gone_keys[base:base + 4096])["results"]
                assert all(r == [0, False] for r in gone)
            # an unacknowledged remove: either gone, or there with every replica
            for k in unsure & committed.keys():
                try:
                    got = c.call(Op.GET_REPLICA_LIST, key=k)
                except MasterRPCError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND, k
                else:
                    assert sorted((x[0], x[1]) for x in got["replicas"]) == committed[k], k
            # allocator state was rebuilt: new puts never overlap restored replicas
            used = {(x[0], x[1]) for v in live.values() for x in v}
            r = c.call(Op.BATCH_PUT_START, client_id="c1",
                       items=[{"key": f"new{i}", "size": 1000} for i in range(50)])
            for code, reps in r["results"]:
                assert code == 0 and (reps[0][0], reps[0][1]) not in used


def test_snapshot_compacts_journal_and_restores(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data, extra_args=["--snapshot-keep", "1"]) as m:
        with m.client() as c:
            mount(c, "a")
            n = 3000
            for base in range(0, n, 500):
                keys = [f"k{i}" for i in range(base, base + 500)]
                c.call(Op.BATCH_PUT_START, client_id="c1",
                       items=[{"key": k, "size": 100} for k in keys])
                c.call(Op.BATCH_PUT_END, client_id="c1", keys=keys)
            assert m.pid is not None
            os.kill(m.pid, signal.SIGUSR1)
            st = wait_stats(c, lambda s: s["snapshots"] >= 1)
            assert st["snapshots"] == 1 and st["last_snapshot_pause_ms"] < 1000
            # after the snapshot: more changes land in the new journal
            c.call(Op.REMOVE, key="k0")
            c.call(Op.PUT_START, client_id="c1", key="after", size=100)
            c.call(Op.PUT_END, client_id="c1", key="after")
            os.kill(m.pid, signal.SIGUSR1)
            wait_stats(c, lambda s: s["snapshots"] >= 2)
            c.call(Op.REMOVE, key="k1")
        snaps = list_snapshots(data)
        assert len(snaps) == 1  # keep 1
        assert [s for s, _ in list_journals(data)] == [snaps[0][0]]  # older journals compacted
        m.kill()
        m.start()
        with m.client() as c:
            c.call(Op.PING, client_id="c1")
            st = c.call(Op.STATS)
            assert st["objects"] == n - 2 + 1
            ex = c.call(Op.BATCH_EXIST, keys=["k0", "k1", "k2", "after", f"k{n - 1}"])["results"]
            assert [r[1] for r in ex] == [False, False, True, True, True]


def test_torn_and_corrupt_journal_tail_truncated(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data) as m:
        with m.client() as c:
            mount(c, "a")
            for i in range(20):
                c.call(Op.PUT_START, client_id="c1", key=f"k{i}", size=10)
                c.call(Op.PUT_END, client_id="c1", key=f"k{i}")
        m.kill()
        (_seq, path), = [j for j in list_journals(data) if os.path.getsize(j[1])]
        size = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(b"\x40\x00\x00\x00\x12\x34")  # torn header of a 64-byte record
        m.start()
        with m.client() as c:
            c.call(Op.PING, client_id="c1")
            assert c.call(Op.STATS)["objects"] == 20
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
            c.call(Op.PING, client_id="c1")
            ex = c.call(Op.BATCH_EXIST, keys=[f"k{i}" for i in range(20)])["results"]
            assert [r[1] for r in ex] == [True] * 19 + [False]
            c.call(Op.PUT_START, client_id="c1", key="new", size=10)
            c.call(Op.PUT_END, client_id="c1", key="new")
            assert c.call(Op.EXIST, key="new")["exists"]


def test_owner_that_never_returns_is_dropped_and_remount_readopts(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data, client_ttl_s=1.0) as m:
        with m.client() as c:
            mount(c, "gone", client_id="c-gone")
            mount(c, "back", client_id="c-back")
            for sid in ("gone", "back"):
                c.call(Op.PUT_START, client_id="w", key=f"on-{sid}", size=10,
                       preferred_segments=[sid])
                c.call(Op.PUT_END, client_id="w", key=f"on-{sid}")
        assert m.stop() == 0  # SIGTERM: clean shutdown, exit code 0
        m.start()
        with m.client() as c:
            # a restarted owner process (new client id) mounts the same segment id
            wire = segment_wire("back", "c-back-2", 64 << 20)
            c.call(Op.MOUNT_SEGMENT, client_id="c-back-2", segment=wire)
            g = c.call(Op.GET_REPLICA_LIST, key="on-back")
            assert g["replicas"][0][0] == "back"
            assert g["segments"]["back"]["client_id"] == "c-back-2"
            mismatch = segment_wire("gone", "x", 1 << 20)  # different size: refused
            with pytest.raises(MasterRPCError) as ei:
                c.call(Op.MOUNT_SEGMENT, client_id="x", segment=mismatch)
            assert ei.value.code == ErrorCode.SEGMENT_MISMATCH
            # c-back-2 keeps pinging; "gone"'s owner never returns within client_ttl
            st = wait_stats(c, lambda s: c.call(Op.PING, client_id="c-back-2")
                            and s["segments"] == 1, timeout=5)
            assert st["segments"] == 1
            assert [s["segment_id"] for s in c.call(Op.LIST_SEGMENTS)["segments"]] == ["back"]
            assert not c.call(Op.EXIST, key="on-gone")["exists"]
            assert c.call(Op.EXIST, key="on-back")["exists"]


def test_torn_newest_snapshot_falls_back_to_older_one(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    with MasterProcess(data_dir=data, extra_args=["--snapshot-keep", "2"]) as m:
        with m.client() as c:
            mount(c, "a")
            assert m.pid is not None
            for round_ in range(2):
                keys = [f"r{round_}-{i}" for i in range(300)]
                c.call(Op.BATCH_PUT_START, client_id="c1",
                       items=[{"key": k, "size": 100} for k in keys])
                c.call(Op.BATCH_PUT_END, client_id="c1", keys=keys)
                os.kill(m.pid, signal.SIGUSR1)
                wait_stats(c, lambda s, r=round_: s["snapshots"] >= r + 1)
            c.call(Op.PUT_START, client_id="c1", key="last", size=100)
            c.call(Op.PUT_END, client_id="c1", key="last")
        m.kill()
        snaps = list_snapshots(data)
        assert len(snaps) == 2
        newest = snaps[-1][1]
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) // 2)
        m.start()
        with m.client() as c:
            c.call(Op.PING, client_id="c1")
            st = c.call(Op.STATS)
            assert st["objects"] == 601
            assert "ignoring snapshot" in m.log_tail(20000)
            ex = c.call(Op.BATCH_EXIST, keys=["r0-0", "r1-299", "last"])["results"]
            assert all(r == [0, True] for r in ex)


@pytest.mark.parametrize("policy", ["always", "never"])
def test_fsync_policies_survive_kill9(tmp_path: Path, policy: str) -> None:
    with MasterProcess(data_dir=str(tmp_path / "d"), extra_args=["--journal-fsync", policy]) as m:
        with m.client() as c:
            mount(c, "a")
            keys = [f"k{i}" for i in range(50)]
            c.call(Op.BATCH_PUT_START, client_id="c1", items=[{"key": k, "size": 10} for k in keys])
            c.call(Op.BATCH_PUT_END, client_id="c1", keys=keys)
        m.kill()
        m.start()
        with m.client() as c:
            c.call(Op.PING, client_id="c1")
            assert all(r == [0, True] for r in c.call(Op.BATCH_EXIST, keys=keys)["results"])
