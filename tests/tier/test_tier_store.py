"""The SSD tier end to end: a real master and node daemons with ``--disk-dir``,
clients putting/getting through disk replicas, offload on eviction,
promotion, warm restart after kill -9, refused segment files, full disk."""

from __future__ import annotations

import os
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tier_helpers import pattern

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import GetReplicaList, SegmentKind, Stats
from kvpool.store import Client, ReplicateConfig
from kvpool.store.errors import NoSpace, StoreError
from kvpool.transfer.file_segment import DEFAULT_FILE_NAME, HEADER_SIZE
from support.factories import client_factory

MiB = 1 << 20
DISK = ReplicateConfig(replica_num=0, disk_replica_num=1)


@pytest.fixture
def master(tmp_path: Any, request: Any) -> Iterator[MasterProcess]:
    # short leases let the offload tests evict what they just read; a test
    # reading big objects from disk passes a longer one (indirect parameter):
    # a read that outlasts its lease is refused by design (bytes discarded);
    # no grace: an owner silent for client_ttl is dropped (its file segment kept)
    lease_ms = getattr(request, "param", 300)
    with MasterProcess(data_dir=str(tmp_path / "master"), lease_ttl_ms=lease_ms,
                       client_ttl_s=2, extra_args=["--client-grace-s", "0"]) as m:
        yield m


@pytest.fixture
def make_daemon(master: MasterProcess, tmp_path: Any) -> Iterator[Callable[..., NodeDaemonProcess]]:
    made: list[NodeDaemonProcess] = []

    def make(memory: str = "8MiB", disk: str = "160MiB", disk_dir: str | None = None,
             start: bool = True) -> NodeDaemonProcess:
        ddir = disk_dir or str(tmp_path / f"disk-{len(made)}")
        d = NodeDaemonProcess(master.address, memory,
                              extra_args=["--disk-dir", ddir, "--disk", disk])
        d.disk_dir = ddir  # type: ignore[attr-defined]
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.__exit__()


@pytest.fixture
def make_client(master: MasterProcess) -> Iterator[Callable[..., Client]]:
    with client_factory(master.address, checksum="crc32") as make:
        yield make


def _kinds(master: MasterProcess, key: str) -> list[SegmentKind]:
    with master.client() as mc:
        res = mc.call(GetReplicaList(key))
    return [res.segments[r.segment_id].kind for r in res.replicas]


def _stats(master: MasterProcess) -> dict[str, Any]:
    with master.client() as mc:
        return mc.call(Stats()).as_dict()


def _disk_copies(master: MasterProcess) -> int:
    """Objects copied to disk by the tier: offloads at eviction plus the
    copies made ahead of it (with exact LRU, copy-ahead usually wins)."""
    st = _stats(master)
    return int(st.get("offload_done", 0)) + int(st.get("copy_ahead_done", 0))


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def _get_eventually(c: Client, key: str, timeout: float = 15.0) -> bytes:
    """Get, retrying while a restarted node's segment is being re-adopted."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return c.get(key)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _put_retry(c: Client, key: str, value: bytes, cfg: ReplicateConfig | None = None) -> None:
    """Put, waiting while memory is full and offloads are still copying."""
    deadline = time.monotonic() + 20
    while True:
        try:
            c.put(key, value, cfg)
            return
        except NoSpace:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("master", [10_000], indirect=True)  # 64 MiB reads on a busy disk
def test_put_get_through_disk_replicas_with_checksums(make_daemon, make_client, master):
    make_daemon()
    c = make_client()
    tag = uuid.uuid4().hex[:6]
    for size in (1, 4097, MiB + 3, 16 * MiB + 1, 64 * MiB):
        key = f"{tag}/{size}"
        data = pattern(size, size).tobytes()
        c.put(key, data, DISK)
        assert _kinds(master, key) == [SegmentKind.FILE]
        got = c.get(key)
        assert len(got) == size and zlib.crc32(got) == zlib.crc32(data)
    both = f"{tag}/both"
    c.put(both, b"x" * 5000, ReplicateConfig(replica_num=1, disk_replica_num=1))
    assert sorted(_kinds(master, both)) == [SegmentKind.MEMORY, SegmentKind.FILE]


def test_eviction_offloads_to_disk_and_serves_from_there(make_daemon, make_client, master):
    make_daemon(memory="8MiB")
    c = make_client()
    tag = uuid.uuid4().hex[:6]
    values = {f"{tag}/{i}": pattern(i, MiB - 17 * i).tobytes() for i in range(24)}
    for k, v in values.items():  # 3x the memory
        _put_retry(c, k, v)
    _wait(lambda: _disk_copies(master) >= 8)
    on_disk = [k for k in values if _kinds(master, k) == [SegmentKind.FILE]]
    assert len(on_disk) >= 8
    for k, v in values.items():
        got = c.get(k)
        assert zlib.crc32(got) == zlib.crc32(v), k
    st = _stats(master)
    assert st["file_used"] > 0 and st["memory_used"] <= st["memory_capacity"]


def test_promotion_on_disk_hit(make_daemon, make_client, master):
    make_daemon(memory="8MiB")
    c = make_client()
    key = f"{uuid.uuid4().hex[:6]}/cold"
    data = pattern(7, 300_001).tobytes()
    c.put(key, data, DISK)
    assert _kinds(master, key) == [SegmentKind.FILE]
    assert c.get(key) == data  # served from disk
    assert c.get(key) == data  # the second read from disk queues a promotion
    _wait(lambda: SegmentKind.MEMORY in _kinds(master, key))
    assert c.get(key) == data
    assert _stats(master)["promote_done"] >= 1


def test_promotion_at_first_hit_from_the_command_line(tmp_path):
    with MasterProcess(data_dir=str(tmp_path / "m1"), extra_args=["--promote-after-hits", "1"]
                       ) as m, NodeDaemonProcess(m.address, "8MiB", extra_args=[
                           "--disk-dir", str(tmp_path / "d1"), "--disk", "32MiB"]), \
            client_factory(m.address) as make:
        c = make()
        data = pattern(8, 70_000).tobytes()
        c.put("one", data, DISK)
        assert c.get("one") == data
        _wait(lambda: SegmentKind.MEMORY in _kinds(m, "one"))


def test_kill9_and_restart_on_same_disk_dir_readopts_objects(make_daemon, make_client, master):
    d = make_daemon(memory="8MiB")
    c = make_client()
    tag = uuid.uuid4().hex[:6]
    values = {f"{tag}/{i}": pattern(100 + i, 200_000 + i).tobytes() for i in range(10)}
    for k, v in values.items():
        c.put(k, v, DISK)
    old_ids = set(d.segment_ids)
    d.restart(kill=True)  # at once: the master still thinks the old owner lives
    assert set(d.segment_ids) & old_ids  # the file segment id came back from the header
    for k, v in values.items():
        assert _get_eventually(c, k) == v
    # and again after the master gave up on the old owner (client_ttl 2 s)
    d.kill()
    time.sleep(3.5)
    d.start()
    for k, v in values.items():
        assert _get_eventually(c, k) == v


def test_mismatched_or_truncated_segment_file_is_refused(make_daemon, tmp_path):
    bad = tmp_path / "foreign"
    bad.mkdir()
    (bad / DEFAULT_FILE_NAME).write_bytes(os.urandom(HEADER_SIZE + MiB))
    d = make_daemon(disk_dir=str(bad), start=False)
    with pytest.raises(KVPoolError) as ei:
        d.start()
    assert "SEGMENT_MISMATCH" in str(ei.value)
    # a real segment file of another size is refused too, and never rewritten
    good = make_daemon(disk="16MiB")
    good.stop()
    path = os.path.join(good.disk_dir, DEFAULT_FILE_NAME)  # type: ignore[attr-defined]
    os.truncate(path, HEADER_SIZE + MiB)
    again = make_daemon(disk="16MiB", disk_dir=good.disk_dir,  # type: ignore[attr-defined]
                        start=False)
    with pytest.raises(KVPoolError) as ei:
        again.start()
    assert "truncated" in str(ei.value)
    assert os.path.getsize(path) == HEADER_SIZE + MiB


def test_restart_with_another_disk_size_starts_the_tier_afresh(make_daemon, make_client):
    """SGLang derives the SSD size from the free disk: a restart with a smaller
    or a larger size runs, with an empty tier (old objects are misses, never
    another object's bytes), and the new tier takes objects."""
    d = make_daemon(disk="16MiB")
    c = make_client()
    tag = uuid.uuid4().hex[:6]
    old = pattern(7, 300_000).tobytes()
    c.put(f"{tag}/old", old, DISK)
    d.stop()
    for i, disk in enumerate(("8MiB", "32MiB")):
        again = make_daemon(disk=disk, disk_dir=d.disk_dir)  # type: ignore[attr-defined]
        assert c.get_batch([f"{tag}/old"]) == [None]  # gone with the old tier
        v = pattern(8 + i, 200_000).tobytes()
        _put_retry(c, f"{tag}/new{i}", v, DISK)
        assert c.get(f"{tag}/new{i}") == v
        again.stop()


def test_full_disk_gives_no_available_handle(make_daemon, make_client, master):
    make_daemon(memory="8MiB", disk="4MiB")
    c = make_client()
    with pytest.raises(StoreError) as ei:
        c.put(f"{uuid.uuid4().hex[:6]}/huge", b"z" * (5 * MiB), DISK)
    assert ei.value.code == ErrorCode.NO_AVAILABLE_HANDLE
    # the disk tier keeps working (LRU among disk-only objects)
    tag = uuid.uuid4().hex[:6]
    for i in range(12):
        _put_retry(c, f"{tag}/{i}", pattern(i, MiB).tobytes(), DISK)
    assert c.get(f"{tag}/11") == pattern(11, MiB).tobytes()
    assert _stats(master)["objects"] >= 1


def test_offload_to_another_hosts_disk_over_tcp(master, make_client, tmp_path):
    """Memory on one host, the disk tier on another: the memory node writes
    the evicted objects through the disk node's transfer server (tcp)."""
    mem = NodeDaemonProcess(master.address, "8MiB", host_id="host-mem")
    disk = NodeDaemonProcess(master.address, "0", host_id="host-disk", extra_args=[
        "--disk-dir", str(tmp_path / "remote-disk"), "--disk", "64MiB"])
    try:
        mem.start()
        disk.start()
        c = make_client(host_id="host-reader")
        tag = uuid.uuid4().hex[:6]
        values = {f"{tag}/{i}": pattern(50 + i, MiB + i).tobytes() for i in range(20)}
        for k, v in values.items():
            _put_retry(c, k, v)
        # one eviction round offloads ~5 of the 8 MiB (puts that find no room
        # meanwhile spill to the disk directly, and are not copies): at least 3
        _wait(lambda: _disk_copies(master) >= 3)
        assert any(_kinds(master, k) == [SegmentKind.FILE] for k in values)
        for k, v in values.items():
            assert c.get(k) == v, k
    finally:
        mem.__exit__()
        disk.__exit__()


def test_master_and_node_restart_readopt_disk_objects_from_the_journal(
        make_daemon, make_client, master):
    """Both the master (kill -9: state from its journal) and the node come back;
    the node's file segment and every object recorded in it are adopted again,
    also after the master gave up waiting for the owner (client_ttl 2 s)."""
    d = make_daemon(memory="8MiB")
    c = make_client()
    tag = uuid.uuid4().hex[:6]
    values = {f"{tag}/{i}": pattern(200 + i, 100_000 + 7 * i).tobytes() for i in range(8)}
    for k, v in values.items():
        c.put(k, v, DISK)
    d.stop()  # clean stop: the file segment stays mounted (kept for a restart)
    master.restart(kill=True)
    time.sleep(3.5)  # longer than client_ttl (+ grace 0): restored memory segments dropped
    assert _stats(master)["file_segments_awaiting"] == 1
    d.start()
    for k, v in values.items():
        assert _get_eventually(c, k) == v
