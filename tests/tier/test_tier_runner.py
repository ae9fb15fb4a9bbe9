"""The node-side tier task runner copies real bytes between real segments:
shm -> own file (offload), own file -> shm (promotion), shm -> a file segment
owned by another process on this host (posix) and on another host (tcp)."""

from __future__ import annotations

import time
import uuid
import zlib

import numpy as np
import pytest
from tier_helpers import pattern

from kvpool.cluster.processes import find_free_port
from kvpool.core.rpc_client import MasterClient
from kvpool.store.tier_tasks import TierTask, TierTaskRunner
from kvpool.transfer import MemorySegment
from kvpool.transfer.file_segment import FileSegment

MiB = 1 << 20


@pytest.fixture
def node(make_engine, tmp_path):
    engine = make_engine(host_id="host-tier")
    mem = MemorySegment.create(f"mem-{uuid.uuid4().hex[:6]}", 8 * MiB)
    disk = FileSegment.open(str(tmp_path / "disk"), 8 * MiB)
    engine.add_local_segment(mem)
    engine.add_local_segment(disk)
    # nobody listens here: reports fail quietly (the master would time tasks out)
    master = MasterClient(f"tcp://127.0.0.1:{find_free_port()}", timeout_s=0.2)
    runner = TierTaskRunner(engine, master, "node-1", transfer_timeout_s=10)
    yield engine, mem, disk, runner
    runner.close()
    master.close()
    disk.close()
    mem.close()


def _wait(runner: TierTaskRunner, n: int) -> None:
    deadline = time.monotonic() + 20
    while runner.done + runner.failed < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.done + runner.failed == n


def _task(i: int, kind: int, size: int, src: tuple[str, int], dst: tuple[str, int]) -> dict:
    return {"id": i, "kind": kind, "key": f"k{i}", "size": size, "src": list(src),
            "dst": list(dst)}


def test_offload_and_promote_between_own_segments(node):
    _engine, mem, disk, runner = node
    data = pattern(1, 3 * MiB + 5)
    mem.array()[100:100 + data.size] = data
    runner.submit([_task(1, 1, data.size, (mem.segment_id, 100), (disk.segment_id, 4096))])
    _wait(runner, 1)
    out = np.empty(data.size, np.uint8)
    disk.read_into(4096, out)
    assert runner.done == 1 and np.array_equal(out, data)
    runner.submit([_task(2, 2, data.size, (disk.segment_id, 4096), (mem.segment_id, 4 * MiB))])
    _wait(runner, 2)
    assert runner.done == 2
    assert np.array_equal(mem.array()[4 * MiB:4 * MiB + data.size], data)
    # what the node's metrics read: tasks by kind and result, bytes, the file's I/O
    assert runner.by_kind == {("offload", True): 1, ("promote", True): 1}
    assert runner.bytes_by_kind == {"offload": data.size, "promote": data.size}
    assert disk.io.write_bytes == data.size and disk.io.writes == 1
    assert disk.io.read_bytes == 2 * data.size and disk.io.reads == 2  # (one is the test's)


def test_offload_to_peer_file_same_host_and_remote(node, make_file_peer, tmp_path):
    _engine, mem, _disk, runner = node
    near = make_file_peer(str(tmp_path / "near"), 8 * MiB, host_id="host-tier")
    far = make_file_peer(str(tmp_path / "far"), 8 * MiB, host_id="other-host")
    data = pattern(2, 2 * MiB + 1)
    mem.array()[:data.size] = data
    segs = {near.desc.segment_id: near.desc.to_wire(), far.desc.segment_id: far.desc.to_wire()}
    runner.submit([_task(1, 1, data.size, (mem.segment_id, 0), (near.desc.segment_id, 7)),
                   _task(2, 1, data.size, (mem.segment_id, 0), (far.desc.segment_id, 9))], segs)
    _wait(runner, 2)
    assert runner.done == 2
    crc = zlib.crc32(data.data)
    assert near.crc(7, data.size) == crc and far.crc(9, data.size) == crc


def test_bad_tasks_fail_without_killing_the_runner(node):
    _engine, mem, disk, runner = node
    assert runner.submit([{"id": "x"}]) == 0  # malformed: ignored
    runner.submit([_task(1, 1, 10, ("not-ours", 0), (disk.segment_id, 0)),
                   _task(2, 1, 10, (mem.segment_id, 0), ("unknown-dst", 0)),
                   _task(3, 1, 16, (mem.segment_id, 0), (disk.segment_id, 8 * MiB - 8))])
    _wait(runner, 3)
    assert runner.failed == 3 and runner.done == 0
    runner.submit([_task(4, 1, 16, (mem.segment_id, 0), (disk.segment_id, 0))])
    _wait(runner, 4)
    assert runner.done == 1
    assert runner.by_kind == {("offload", False): 3, ("offload", True): 1}
    assert runner.bytes_by_kind == {"offload": 16}


def test_task_wire_roundtrip():
    t = TierTask.from_wire({**_task(5, 2, 77, ("a", 1), ("b", 2)), "cap": b"token"})
    w = t.wire
    assert (w.id, w.kind, w.key, w.size, w.src_id, w.src_off, w.dst_id, w.dst_off,
            t.capability) == (5, 2, "k5", 77, "a", 1, "b", 2, b"token")
    assert TierTask.from_wire(_task(5, 2, 77, ("a", 1), ("b", 2))).capability == b""


def test_task_past_half_its_ttl_is_not_started(node):
    _engine, mem, disk, runner = node
    mem.array()[:4096] = 7
    w = {**_task(1, 1, 4096, (mem.segment_id, 0), (disk.segment_id, 0)), "ttl_ms": 200}
    time.sleep(0.01)
    runner._q.put((TierTask.from_wire(w), {}))
    _wait(runner, 1)
    assert runner.done == 1  # fresh: copied
    late = TierTask.from_wire({**_task(2, 1, 4096, (mem.segment_id, 0),
                                      (disk.segment_id, 8192)), "ttl_ms": 200})
    late.received -= 0.15  # arrived 150 ms ago: past half of 200 ms
    runner._q.put((late, {}))
    _wait(runner, 2)
    assert runner.failed == 1
    out = np.empty(4096, np.uint8)
    disk.read_into(8192, out)
    assert not out.any()  # nothing written
