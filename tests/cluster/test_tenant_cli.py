"""``kvpool tenant set|list`` and ``kvpool status``'s tenant table against a
real master (docs/tenants.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.protocol import (
    BatchPutEnd,
    BatchPutStart,
    MountSegment,
    SegmentDescriptor,
    SegmentKind,
)

pytestmark = pytest.mark.timeout(60)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", *args],
                          capture_output=True, text=True, timeout=30)


def test_tenant_set_list_and_status_round_trip(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("tenants:\n  a: {memory: 32MiB, disk: 1GiB, guaranteed: 8MiB}\n")
    with MasterProcess(data_dir=str(tmp_path / "d"), extra_args=["--config", str(cfg)]) as m:
        addr = m.address
        with m.client() as c:
            c.call(MountSegment("c1", SegmentDescriptor("s1", "c1", "h", SegmentKind.MEMORY,
                                                        1 << 26, "kvpool-tcli-s1")))
            c.call(BatchPutStart("c1", ["k0", "k1"], [1000, 1000], tenant="a"))
            c.call(BatchPutEnd(client_id="c1", keys=["k0", "k1"], tenant="a"))
        out = _cli("tenant", "set", "b", "--memory", "1MiB", "--disk", "unlimited",
                   "--master", addr)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.split("\n")[1].split()[:3] == ["b", "0B", "1.0MiB"]
        out = _cli("tenant", "list", "--master", addr, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        rows = {r["name"]: r for r in json.loads(out.stdout)}
        assert list(rows) == ["default", "a", "b"]
        assert rows["a"]["memory_quota"] == 32 << 20 and rows["a"]["disk_quota"] == 1 << 30
        assert rows["a"]["guaranteed"] == 8 << 20
        assert (rows["a"]["memory_used"], rows["a"]["objects"]) == (2000, 2)
        assert rows["b"]["memory_quota"] == 1 << 20 and rows["b"]["disk_quota"] == -1
        assert rows["default"]["memory_used"] == -1  # not counted unless listed
        out = _cli("status", "--master", addr)
        assert out.returncode == 0, out.stdout + out.stderr
        table = out.stdout[out.stdout.index("TENANT"):].splitlines()
        assert [line.split()[0] for line in table] == ["TENANT", "default", "a", "b"]
        out = _cli("status", "--master", addr, "--json")
        doc = json.loads(out.stdout)
        assert [t["name"] for t in doc["tenants"]] == ["default", "a", "b"]
        # bad input: a clear error, exit 1, the master keeps serving
        out = _cli("tenant", "set", "bad/name", "--memory", "1MiB", "--master", addr)
        assert out.returncode == 1 and "invalid tenant name" in out.stdout
        out = _cli("tenant", "set", "c", "--memory", "lots", "--master", addr)
        assert out.returncode == 2 and "not a size" in out.stderr
        assert _cli("tenant", "list", "--master", addr).returncode == 0
