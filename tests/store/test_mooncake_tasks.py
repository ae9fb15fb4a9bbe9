"""Mooncake's copy/move tasks, replica clear per segment, upsert and soft pins
on kvpool, written from Mooncake's own tests (``scripts/test_copy_move_api.py``,
``scripts/test_upsert_api.py``) and API reference: three stores stand for the
three storage servers, a fourth with no memory coordinates. Real master, real
segments; every copy checked through the replica descriptors and the bytes."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.store.mooncake import (
    MooncakeDistributedStore,
    QueryTaskResponse,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
)

pytestmark = pytest.mark.timeout(120)

LEASE_MS = 500
SEG = 16 << 20
INVALID = int(ErrorCode.INVALID_PARAMS)


Cluster = tuple[MooncakeDistributedStore, list[str], list[MooncakeDistributedStore]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """(coordinator, the servers' segment names, the servers)."""
    d = tmp_path_factory.mktemp("mc-tasks")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=LEASE_MS, client_ttl_s=3) as m:
        servers = []
        for size in (SEG, SEG, 2 * SEG):
            s = MooncakeDistributedStore()
            assert s.setup("localhost", "P2PHANDSHAKE", size, 2 * size, "tcp", "",
                           m.address) == 0
            servers.append(s)
        coord = MooncakeDistributedStore()
        assert coord.setup("localhost", "P2PHANDSHAKE", 0, 2 * SEG, "tcp", "", m.address) == 0
        try:
            yield coord, [s.get_hostname() for s in servers], servers
        finally:
            coord.remove_all(True)
            for s in [coord, *servers]:
                assert s.close() == 0


def until_done(store: MooncakeDistributedStore, task_id: tuple[int, int]) -> QueryTaskResponse:
    deadline = time.monotonic() + 30
    while True:
        resp, err = store.query_task(task_id)
        assert err == 0, err
        assert resp is not None
        if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            return resp
        assert time.monotonic() < deadline, resp
        time.sleep(0.1)


def endpoints(store: MooncakeDistributedStore, key: str) -> list[str]:
    return sorted(d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                  for d in store.get_replica_desc(key) if d.is_memory_replica())


def put_on(store: MooncakeDistributedStore, key: str, payload: bytes, *segments: str) -> None:
    cfg = ReplicateConfig()
    cfg.replica_num = len(segments)
    cfg.preferred_segments = list(segments)
    assert store.put(key, payload, cfg) == 0
    assert endpoints(store, key) == sorted(segments)


def test_copy_then_move(cluster: Cluster) -> None:
    coord, segs, servers = cluster
    payload = os.urandom(2 << 20)
    put_on(coord, "copy_key", payload, segs[0])
    task_id, err = coord.create_copy_task("copy_key", segs[1:])
    assert err == 0 and task_id[1] > 0
    resp = until_done(coord, task_id)
    assert resp.status == TaskStatus.SUCCESS and resp.type == TaskType.REPLICA_COPY
    assert resp.id == task_id and resp.last_updated_at_ms_epoch >= resp.created_at_ms_epoch
    assert resp.assigned_client != (0, 0)
    assert endpoints(coord, "copy_key") == sorted(segs)
    # every replica holds the bytes: drop the others one by one and read
    for seg in segs[:2]:
        time.sleep(LEASE_MS / 1000 + 0.1)
        assert coord.batch_replica_clear(["copy_key"], seg) == ["copy_key"]
        assert coord.get("copy_key") == payload
    assert endpoints(coord, "copy_key") == [segs[2]]
    # move it from the last server to the first
    task_id, err = coord.create_move_task("copy_key", segs[2], segs[0])
    assert err == 0
    resp = until_done(coord, task_id)
    assert (resp.status, resp.type) == (TaskStatus.SUCCESS, TaskType.REPLICA_MOVE)
    assert endpoints(coord, "copy_key") == [segs[0]]
    assert coord.get("copy_key") == payload
    assert servers[0].get("copy_key") == payload  # its own segment, same bytes


def test_errors_as_mooncake(cluster: Cluster
                            ) -> None:
    coord, segs, _ = cluster
    assert coord.create_copy_task("nonexistent_key", segs[1:])[1] == -704
    assert coord.create_move_task("nonexistent_key", segs[0], segs[1])[1] == -704
    put_on(coord, "err_key", os.urandom(2048), segs[0])
    assert coord.create_copy_task("err_key", ["unknown_segment_1"]) == ((0, 0), INVALID)
    assert coord.create_move_task("err_key", "unknown_source", segs[1])[1] == INVALID
    assert coord.create_move_task("err_key", segs[0], "unknown_destination")[1] == INVALID
    assert coord.create_move_task("err_key", segs[0], segs[0])[1] == INVALID  # same segment
    assert coord.query_task((0, 1 << 40)) == (None, int(ErrorCode.TASK_NOT_FOUND))
    # a copy onto segments that hold it already changes nothing
    put_on(coord, "twice", os.urandom(2048), segs[0], segs[1])
    task_id, err = coord.create_copy_task("twice", [segs[1]])
    assert err == 0 and until_done(coord, task_id).status == TaskStatus.SUCCESS
    assert endpoints(coord, "twice") == sorted(segs[:2])


def test_concurrent_copies_and_moves(
        cluster: Cluster) -> None:
    coord, segs, _ = cluster
    rng = random.Random(7)
    n = 40
    homes = {f"cc_{i}": rng.choice(segs) for i in range(n)}
    data = {k: os.urandom(2048) for k in homes}
    for k, home in homes.items():
        put_on(coord, k, data[k], home)
    with cf.ThreadPoolExecutor(8) as ex:
        futs = {ex.submit(coord.create_copy_task, k, [s for s in segs if s != home]): k
                for k, home in homes.items()}
        ids = {futs[f]: f.result() for f in cf.as_completed(futs)}
        assert all(err == 0 for _, err in ids.values())
        done = list(ex.map(lambda t: until_done(coord, t[0]), ids.values()))
    assert all(r.status == TaskStatus.SUCCESS for r in done)
    for k in homes:
        assert endpoints(coord, k) == sorted(segs)
    # then move each key's replica off one segment onto ... a segment that has
    # one: the move drops the source only; then a real move after a clear
    time.sleep(LEASE_MS / 1000 + 0.1)
    dests = {}
    for k, home in homes.items():
        other = next(s for s in segs if s != home)
        assert coord.batch_replica_clear([k], other) == [k]
        dests[k] = other
    with cf.ThreadPoolExecutor(8) as ex:
        ids2 = list(ex.map(lambda k: coord.create_move_task(k, homes[k], dests[k]), homes))
        assert all(err == 0 for _, err in ids2)
        done = list(ex.map(lambda t: until_done(coord, t[0]), ids2))
    assert all(r.status == TaskStatus.SUCCESS for r in done)
    for k, home in homes.items():
        got = endpoints(coord, k)
        assert home not in got and dests[k] in got and len(got) == 2
        assert coord.get(k) == data[k]


def test_replica_clear_only_by_writer_and_after_lease(
        cluster: Cluster) -> None:
    coord, segs, servers = cluster
    put_on(coord, "rc", b"x" * 100, segs[0], segs[1])
    assert coord.get("rc") == b"x" * 100  # a read lease
    assert coord.batch_replica_clear(["rc"], segs[0]) == []
    time.sleep(LEASE_MS / 1000 + 0.1)
    assert servers[0].batch_replica_clear(["rc"], segs[0]) == []  # not its writer
    assert coord.batch_replica_clear(["rc", "missing", ""], segs[0]) == ["rc"]
    assert endpoints(coord, "rc") == [segs[1]]
    assert coord.batch_replica_clear(["rc"], segs[0]) == []  # none there any more
    time.sleep(LEASE_MS / 1000 + 0.1)  # get_replica_desc leased it too
    assert coord.batch_replica_clear(["rc"], "") == ["rc"] and coord.get("rc") == b""


def test_upsert_never_hides_the_key_from_readers(
        cluster: Cluster) -> None:
    coord, _segs, servers = cluster
    reader = servers[1]
    assert coord.put("hot", b"v0" * 1000) == 0
    stop = threading.Event()
    seen: list[bytes] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(reader.get("hot"))

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(1, 30):
            size = 1000 if i % 2 else 1500  # same and different sizes
            assert coord.upsert("hot", f"v{i % 10}".encode() * size) == 0
    finally:
        stop.set()
        t.join()
    assert seen and b"" not in seen  # never missing, never torn
    assert all(v[:2] * (len(v) // 2) == v for v in seen)
    assert coord.get("hot") == b"v9" * 1000


def test_upsert_keeps_hard_pin_and_soft_pin_actions(
        cluster: Cluster) -> None:
    coord = cluster[0]
    master = coord._c()
    hard = ReplicateConfig()
    hard.with_hard_pin = True
    assert coord.put("hp", b"a", hard) == 0
    assert coord.upsert("hp", b"bb") == 0 and coord.get("hp") == b"bb"
    pin = ReplicateConfig()
    pin.soft_pin_action = SoftPinAction.ENABLE
    pin.soft_pin_ttl_ms = 60_000
    before = master.stats().soft_pinned
    assert coord.upsert("sp", b"a", pin) == 0
    assert master.stats().soft_pinned == before + 1
    assert coord.upsert("sp", b"b") == 0  # PRESERVE keeps it
    assert master.stats().soft_pinned == before + 1
    off = ReplicateConfig()
    off.soft_pin_action = SoftPinAction.DISABLE
    assert coord.upsert("sp", b"c", off) == 0
    assert master.stats().soft_pinned == before
    pin.soft_pin_ttl_ms = 48 * 3600 * 1000  # above the master's max_soft_pin_ttl_ms
    assert coord.upsert("sp", b"d", pin) == INVALID and coord.get("sp") == b"c"


def test_group_ids_lease_groups_and_stay_fixed(cluster: Cluster) -> None:
    coord = cluster[0]
    cfg = ReplicateConfig()
    cfg.group_ids = ["req-1", "req-1", ""]
    assert coord.put_batch(["gk", "gv", "solo"], [b"k" * 64, b"v" * 64, b"s"], cfg) == 0
    assert coord.get("gk") == b"k" * 64  # leases gv too: it is in the same group
    assert coord.remove("gv") == int(ErrorCode.OBJECT_HAS_LEASE)
    assert coord.remove("solo") == 0
    other = ReplicateConfig()
    other.group_ids = ["req-2"]
    assert coord.upsert("gk", b"x", other) == INVALID  # membership is fixed
    assert coord.upsert("gk", b"x") == 0 and coord.get("gk") == b"x"
    bad = ReplicateConfig()
    bad.group_ids = ["a", "b"]
    assert coord.put("gx", b"1", bad) == INVALID  # one entry per key
    time.sleep(LEASE_MS / 1000 + 0.1)
    assert coord.batch_remove(["gk", "gv"]) == [0, 0]


def test_copy_onto_an_ssd_tier_and_move_back(cluster: Cluster, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    coord, segs, _ = cluster
    monkeypatch.setenv("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", str(16 << 20))
    ssd = MooncakeDistributedStore()
    assert ssd.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "",
                     coord._c().config.master_address, enable_ssd_offload=True,
                     ssd_offload_path=str(tmp_path / "ssd")) == 0
    try:
        disk = next(d.descriptor.segment_id for d in ssd._c().list_segments()
                    if d.descriptor.kind == SegmentKind.FILE
                    and d.descriptor.segment_id in ssd._c().segment_ids)
        payload = os.urandom(300_000)
        put_on(coord, "to_disk", payload, segs[0])
        task_id, err = coord.create_copy_task("to_disk", [disk])
        assert err == 0 and until_done(coord, task_id).status == TaskStatus.SUCCESS
        descs = coord.get_replica_desc("to_disk")
        assert sorted(d.is_disk_replica() for d in descs) == [False, True]
        # move the memory replica off: the disk replica alone serves the bytes
        task_id, err = coord.create_move_task("to_disk", segs[0], disk)
        assert err == 0 and until_done(coord, task_id).status == TaskStatus.SUCCESS
        (d,) = coord.get_replica_desc("to_disk")
        assert d.is_disk_replica() and coord.get("to_disk") == payload
        # and back into memory on another server; the reads above (disk hits)
        # may have started a promotion: -708 while it runs, as Mooncake
        deadline = time.monotonic() + 30
        while True:
            task_id, err = coord.create_move_task("to_disk", disk, segs[1])
            if err != int(ErrorCode.OBJECT_HAS_REPLICATION_TASK):
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert err == 0 and until_done(coord, task_id).status == TaskStatus.SUCCESS
        descs = coord.get_replica_desc("to_disk")
        assert not any(d.is_disk_replica() for d in descs)
        assert segs[1] in endpoints(coord, "to_disk") and coord.get("to_disk") == payload
    finally:
        assert ssd.close() == 0
