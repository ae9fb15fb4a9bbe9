"""Tier tasks reach their node by a long poll (kvpool.master.parked).

A node running SSD-tier tasks sends ``Ping(wait_ms=W)``; the master holds it
while it has nothing for the node and answers it as soon as a task for the
node is queued. Real master process, a real store client owning a memory
segment and a disk tier (its ping thread, its tier runner), real puts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tier_helpers import pattern

from kvpool.cluster.processes import MasterProcess
from kvpool.core.protocol import BatchGetReplicaList, Ping, SegmentKind, Stats
from kvpool.core.rpc_client import MasterClient
from kvpool.store import Client, ClientConfig

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(data_dir=str(tmp_path / "master"), client_ttl_s=30) as m:
        yield m


def test_offload_tasks_reach_a_node_whose_ping_interval_is_long(
        master: MasterProcess, tmp_path: Path) -> None:
    """A node pinging every 30 s gets its offload-ahead tasks within seconds:
    its held PING is answered when they are queued (before the long poll it
    waited for its next ping, 30 s here, past this test's bound)."""
    cfg = ClientConfig(master_address=master.address, memory_size=32 * MiB,
                       disk_dir=str(tmp_path / "disk"), disk_size=256 * MiB,
                       ping_interval_s=30.0, guard=False)
    with Client(cfg) as node:
        time.sleep(0.5)  # the node's first PING is held by now (it waits up to 5 s)
        values = {f"lp/{i}": pattern(i, MiB).tobytes() for i in range(26)}  # > 70% of 32 MiB
        for key, value in values.items():
            node.put(key, value)
        keys = list(values)
        deadline = time.monotonic() + 15
        on_disk: list[str] = []
        with master.client() as mc:
            while time.monotonic() < deadline:
                res = mc.call(BatchGetReplicaList(keys))
                on_disk = [k for k, code, reps in zip(keys, res.codes, res.replicas, strict=True)
                           if not code and any(res.segments[r.segment_id].kind
                                               == SegmentKind.FILE for r in reps)]
                if on_disk:
                    break
                time.sleep(0.1)
            assert on_disk, "no offload-ahead copy reached the disk tier in 15 s"
            assert mc.call(Stats()).objects == len(keys)
        for key in on_disk:  # the copies are the bytes (read from memory or disk)
            assert node.get(key) == values[key]


def test_a_held_ping_is_answered_at_its_wait_or_by_the_clients_next_ping(
        master: MasterProcess) -> None:
    """A PING that asks to wait is held (nothing to hand its node) until its
    wait ends, answered at once when the same client pings without waiting,
    and never held on the same-host direct socket."""
    with Client(ClientConfig(master_address=master.address, memory_size=4 * MiB,
                             guard=False)) as owner:
        cid = owner.client_id
        with MasterClient(master.address, timeout_s=10, local="off") as zmq_stub:
            t0 = time.monotonic()
            assert not zmq_stub.call(Ping(cid, wait_ms=1200)).remount
            assert time.monotonic() - t0 >= 0.9  # held (a 50 ms loop turn of slack)

            took: list[float] = []

            def held() -> None:
                t = time.monotonic()
                zmq_stub.call(Ping(cid, wait_ms=4000))
                took.append(time.monotonic() - t)

            th = threading.Thread(target=held)
            th.start()
            time.sleep(0.5)
            assert not took  # still held
            with MasterClient(master.address, timeout_s=5, local="off") as other:
                other.call(Ping(cid))  # no wait: answers the held one
            th.join(10)
            assert took and took[0] < 3.0, took  # well before its 4 s wait
            # nothing to wait for when the client is unknown (it must re-mount) or
            # the wait is not positive
            t0 = time.monotonic()
            assert zmq_stub.call(Ping("f" * 32, wait_ms=3000)).remount
            zmq_stub.call(Ping(cid, wait_ms=-5))
            assert time.monotonic() - t0 < 1.5
        with MasterClient(master.address, timeout_s=10) as direct:
            direct.call(Ping(cid))  # (the first call goes over ZeroMQ, the next ones not)
            t0 = time.monotonic()
            direct.call(Ping(cid, wait_ms=3000))
            assert time.monotonic() - t0 < 1.5
            assert direct.local  # over the master's same-host socket
