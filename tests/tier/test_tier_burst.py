"""A write burst larger than a node's DRAM lands on its disk tier.

The way an engine writes through Mooncake's API: a pure client (no segment
of its own) puts 160 x 1 MiB into a node daemon with 64 MiB of memory and a
1 GiB disk tier, as fast as it can. Every put must succeed (memory that
cannot take an object hands it to the disk tier), every object must read
back byte for byte, and again after the daemon is killed with SIGKILL and
restarted on the same disk directory.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from tier_helpers import pattern

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.protocol import BatchGetReplicaList, SegmentKind, Stats
from kvpool.store import MooncakeDistributedStore

MiB = 1 << 20
N = 160


@pytest.fixture
def master(tmp_path: Any) -> Iterator[MasterProcess]:
    with MasterProcess(data_dir=str(tmp_path / "master")) as m:
        yield m


@pytest.fixture
def store(master: MasterProcess) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    # a pure client, as an engine that only reads and writes: no segment of its own
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", master.address) == 0
    yield s
    s.close()


def _kinds(master: MasterProcess, keys: list[str]) -> dict[str, set[SegmentKind]]:
    with master.client() as mc:
        res = mc.call(BatchGetReplicaList(keys))
    out: dict[str, set[SegmentKind]] = {}
    for key, code, reps in zip(keys, res.codes, res.replicas, strict=True):
        out[key] = set() if code else {res.segments[r.segment_id].kind for r in reps}
    return out


def _read_all(store: MooncakeDistributedStore, values: dict[str, bytes]) -> list[str]:
    """Keys that do not read back exactly (crc compared, then bytes)."""
    bad = []
    for key, want in values.items():
        got = store.get(key)
        if len(got) != len(want) or zlib.crc32(got) != zlib.crc32(want) or got != want:
            bad.append(key)
    return bad


def test_burst_larger_than_memory_spills_to_disk_and_survives_kill9(
        master: MasterProcess, store: MooncakeDistributedStore, tmp_path: Any) -> None:
    disk_dir = str(tmp_path / "disk")
    daemon = NodeDaemonProcess(master.address, "64MiB",
                               extra_args=["--disk-dir", disk_dir, "--disk", "1GiB"])
    with daemon:
        values = {f"burst/{i}": pattern(i, MiB).tobytes() for i in range(N)}
        codes = [store.put(k, v) for k, v in values.items()]
        assert codes == [0] * N
        with master.client() as mc:
            st = mc.call(Stats())
        assert st.spilled > 0 and st.memory_used <= st.memory_capacity
        assert _read_all(store, values) == []

        # objects still held only in DRAM die with the daemon; the tier copies
        # them to disk while memory stays above offload_ahead_watermark
        keys = list(values)
        deadline = time.monotonic() + 30
        while True:
            kinds = _kinds(master, keys)
            memory_only = [k for k, ks in kinds.items() if SegmentKind.FILE not in ks]
            if not memory_only:
                break
            assert time.monotonic() < deadline, f"{len(memory_only)} objects never reached disk"
            time.sleep(0.1)

        daemon.kill()
        daemon.start()  # same disk dir: the file segment and its objects are re-adopted
        kinds = _kinds(master, keys)
        assert [k for k, ks in kinds.items() if SegmentKind.FILE not in ks] == []
        assert _read_all(store, values) == []
