"""A data dir written by an earlier master restores, and today's writes the same bytes.

``data/datadir-v1/`` was written by the master whose journal records were
plain positional lists (``[3, key, size, flags, checksum, [segment, offset,
...]]`` and so on), with every record kind (mounts of memory and file
segments, puts of one and two replicas with pins and checksums, removes, a
dropped replica, a dropped segment): ``journal/`` one journal of it all,
``snapshot/`` the same operations with a fuzzy snapshot taken midway (the
first journal compacted away). ``data/datadir-v1.json`` is the state both
restored to then. Restoring them now must give that state, and running the
same operations now must write journals byte for byte equal to the old ones.
``KVPOOL_RECORD_OLD_DATADIR=1`` rewrites both from the code as it is: only
for an intended change of the on-disk format (then old data dirs need a
migration).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.config import FsyncPolicy, MasterConfig
from kvpool.master.directory import HARD_PIN, SOFT_PIN, Directory
from kvpool.master.durability import Durability
from kvpool.master.journal import list_journals
from support.clock import Clock

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "datadir-v1"
EXPECTED = DATA / "datadir-v1.json"
KINDS = ("journal", "snapshot")
MEM, FILE = SegmentKind.MEMORY, SegmentKind.FILE


def _cfg(data_dir: str) -> MasterConfig:
    return MasterConfig(data_dir=data_dir, journal_fsync=FsyncPolicy.NEVER,
                        snapshot_interval_s=0, eviction_high_watermark=0.95)


def write_datadir(data_dir: str, snapshot: bool) -> None:
    """The operations whose journals (and, with ``snapshot``, the snapshot
    taken midway) make a fixture."""
    cfg = _cfg(data_dir)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg, clock=Clock()))

    def commit() -> None:
        dur.commit(d.records)

    def put(client: str, key: str, size: int, **kw: Any) -> None:
        code, _ = d.put_start(client, key, size, **kw)
        assert code == 0, (key, code)
        assert d.put_end(client, key) == 0

    for sid, client, kind, size in (("m0", "c1", MEM, 1 << 20), ("m1", "c2", MEM, 1 << 20),
                                    ("f0", "c1", FILE, 4 << 20), ("m2", "c3", MEM, 1 << 20)):
        d.mount(client, SegmentDescriptor(
            sid, client, "h", kind, size, f"/disk/{sid}" if kind == FILE else f"kvpool-{sid}",
            base_offset=4096 if kind == FILE else 0,
            extra={"generation": 1} if kind == FILE else {}))
    commit()
    for i in range(40):
        put("c1", f"a{i}", 100 + 37 * i, checksum=i * 7 if i % 3 else None)
    put("c1", "two", 5000, replica_num=2)
    put("c1", "disk", 9000, replica_num=1, disk_replica_num=1)
    put("c2", "hard", 64, flags=HARD_PIN)
    put("c2", "soft", 64, flags=SOFT_PIN, soft_pin_ms=60_000)
    commit()
    for i in range(0, 40, 5):
        assert d.remove(f"a{i}", force=True) == 0
    commit()
    if snapshot:
        dur.request_snapshot()
        dur.tick(d, 0.0)  # rotates to journal 2 and starts the snapshot
    for i in range(40, 60):  # changes while the snapshot is being written
        put("c2", f"b{i}", 4096)
    assert d.removal.clear_many("c1", ["two"], "m1") == [0]  # DROP_REPLICA
    commit()
    while dur.busy:
        dur.tick(d, 0.0)
    put("c3", "on-m2", 777)
    d.unmount("c3", "m2")  # DROP_SEGMENT
    assert d.remove("a1", force=True) == 0
    commit()
    dur.close(d.records)


def state(d: Directory) -> dict[str, Any]:
    return {
        "objects": {k: [o.size, o.flags, o.checksum,
                        [[o.replicas[i].id, o.replicas[i + 1]]
                         for i in range(0, len(o.replicas), 2)]]
                    for k, o in sorted(d.objects.items())},
        "segments": {s.id: [s.desc.client_id, int(s.kind), s.desc.size, s.alloc.used,
                            int(s.state), sorted(s.keys)]
                     for s in sorted(d.segments.values(), key=lambda s: s.id)},
    }


def restore(data_dir: str) -> Directory:
    cfg = _cfg(data_dir)
    dur = Durability(cfg)
    d = dur.restore(lambda: Directory(cfg, clock=Clock()))
    dur.close(d.records)
    return d


def test_record_old_datadir() -> None:
    """Write the fixture (only with ``KVPOOL_RECORD_OLD_DATADIR=1``)."""
    if not os.environ.get("KVPOOL_RECORD_OLD_DATADIR"):
        pytest.skip("records the fixture only when asked")
    shutil.rmtree(FIXTURE, ignore_errors=True)
    states = []
    for kind in KINDS:
        (FIXTURE / kind).mkdir(parents=True)
        write_datadir(str(FIXTURE / kind), kind == "snapshot")
        # a restore opens a new journal: restored from a copy, not the fixture
        scratch = DATA / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(FIXTURE / kind, scratch)
        states.append(state(restore(str(scratch))))
        shutil.rmtree(scratch)
    assert states[0] == states[1]
    EXPECTED.write_text(json.dumps(states[0], separators=(",", ":"), sort_keys=True))


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_datadir_restores(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    shutil.copytree(FIXTURE / kind, data)
    got = json.loads(json.dumps(state(restore(str(data)))))
    assert got == json.loads(EXPECTED.read_text())
    assert len(got["objects"]) > 30 and "m2" not in got["segments"]


@pytest.mark.parametrize("kind", KINDS)
def test_journals_are_written_byte_for_byte_as_before(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    write_datadir(str(data), kind == "snapshot")
    old = list_journals(str(FIXTURE / kind))
    new = list_journals(str(data))
    assert [s for s, _ in new] == [s for s, _ in old] and old
    for (_s, a), (_t, b) in zip(old, new, strict=True):
        assert Path(a).read_bytes() == Path(b).read_bytes(), b
