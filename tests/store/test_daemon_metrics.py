"""A node daemon's /metrics and /health (``kvpool client --metrics-port``), end
to end: a real master and daemon process, a client on another host id (so
its bytes go through the daemon's transfer servers), the SSD tier, the guard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess, find_free_port
from kvpool.store import Client, ClientConfig, ReplicateConfig
from kvpool.store.node_metrics import NodeMetrics
from support.wait import wait_until

pytestmark = pytest.mark.timeout(90)

KiB, MiB = 1 << 10, 1 << 20


def _get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.headers["Content-Type"], r.read()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus page: (name, labels) -> value."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _sum(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
         **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    ctype, body = _get(f"http://127.0.0.1:{port}/metrics")
    assert ctype.startswith("text/plain")
    return _samples(body.decode())


def _health(port: int) -> dict[str, Any]:
    ctype, body = _get(f"http://127.0.0.1:{port}/health")
    assert ctype == "application/json"
    return json.loads(body)  # type: ignore[no-any-return]


def test_daemon_metrics_follow_traffic_and_health_is_json(tmp_path: Path) -> None:
    port = find_free_port()
    disk = tmp_path / "ssd"
    args = ["--metrics-port", str(port), "--disk-dir", str(disk), "--disk", "8MiB"]
    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="16MiB",
                                                 extra_args=args) as d:
        health = _health(port)
        assert health["status"] == "ok", health
        assert health["client_id"] == d.client_id and health["uptime_s"] > 0
        kinds = {s["segment_id"]: s["kind"] for s in health["segments"]}
        assert set(kinds) == set(d.segment_ids) and sorted(kinds.values()) == ["file", "memory"]
        mem_id = next(sid for sid, k in kinds.items() if k == "memory")
        file_id = next(sid for sid, k in kinds.items() if k == "file")
        assert health["guard"]["enabled"] and health["guard"]["alive"], health
        before = _scrape(port)
        assert _sum(before, "kvpool_node_segment_capacity_bytes", segment=mem_id) == 16 * MiB
        assert _sum(before, "kvpool_node_segment_used_bytes", segment=mem_id) == 0
        assert _sum(before, "kvpool_node_guard_alive") == 1
        assert _sum(before, "kvpool_node_master_reachable") == 1

        # a client on another host id: its puts and gets go through the daemon's servers
        cfg = ClientConfig(master_address=m.address, memory_size=0, host_id="elsewhere")
        value = os.urandom(64 * KiB)
        with Client(cfg) as c:
            c.setup()
            for i in range(3):
                c.put(f"k{i}", value)
            c.put("ssd", value, ReplicateConfig(disk_replica_num=1))
            for i in range(3):
                assert c.get(f"k{i}") == value
            # only the SSD replica left: the get reads the daemon's file segment
            c.batch_replica_clear(["ssd"], mem_id)
            assert c.get("ssd") == value
            # the client's own engine counted what it made, by transport and op
            made = {(x.transport, x.op.name): x for x in c.engine.counters.snapshot()}
            assert made[("tcp", "WRITE")].requests >= 5 and made[("tcp", "READ")].requests >= 4
            assert made[("tcp", "WRITE")].bytes >= 5 * len(value)
            # ... and a NodeMetrics over any client pages it as direction="made"
            own = NodeMetrics(c, {})
            try:
                page = _samples(own.routes()["/metrics"]()[1].decode())  # type: ignore[union-attr]
            finally:
                own.close()
            assert _sum(page, "kvpool_node_transfer_requests_total", direction="made",
                        transport="tcp", op="write") >= 5
            assert _sum(page, "kvpool_node_transfer_seconds_count", direction="made",
                        transport="tcp", op="read") >= 4

            served = {"direction": "served"}

            def settled() -> Any:
                # a request is recorded just after its reply went out, and the
                # master's figures are fetched at most once a second
                p = _scrape(port)
                return p if _sum(p, "kvpool_node_transfer_requests_total", op="read",
                                 **served) >= 4 and _sum(
                    p, "kvpool_node_segment_used_bytes", segment=mem_id) else None

            after = wait_until(settled, 5, "the traffic and the master's figures on the page")
            assert _sum(after, "kvpool_node_transfer_requests_total", op="write", **served) >= 5
            assert _sum(after, "kvpool_node_transfer_requests_total", op="read", **served) >= 4
            assert _sum(after, "kvpool_node_transfer_bytes_total", op="write", **served) \
                >= 5 * len(value)
            assert _sum(after, "kvpool_node_transfer_bytes_total", op="read", **served) \
                >= 4 * len(value)
            n = _sum(after, "kvpool_node_transfer_seconds_count", **served)
            assert n >= 9 and _sum(after, "kvpool_node_transfer_seconds_bucket", le="+Inf",
                                   **served) == n
            assert _sum(after, "kvpool_node_transfer_seconds_sum", **served) > 0
            # bytes held and free per segment, as the master accounts them
            used = _sum(after, "kvpool_node_segment_used_bytes", segment=mem_id)
            assert used >= 3 * len(value)
            assert _sum(after, "kvpool_node_segment_free_bytes", segment=mem_id) \
                == 16 * MiB - used
            assert _sum(after, "kvpool_node_segment_objects", segment=mem_id) == 3
            assert _sum(after, "kvpool_node_segment_used_bytes", segment=file_id) >= len(value)
            # the SSD tier's file I/O: the replica written, then read back
            assert _sum(after, "kvpool_node_ssd_bytes_total", segment=file_id,
                        op="write") >= len(value)
            assert _sum(after, "kvpool_node_ssd_bytes_total", segment=file_id,
                        op="read") >= len(value)
            assert _sum(after, "kvpool_node_ssd_ops_total", op="read") >= 1
            promtool = shutil.which("promtool")
            if promtool:  # Prometheus's own linter accepts the page (names, types, units)
                body = _get(f"http://127.0.0.1:{port}/metrics")[1]
                lint = subprocess.run([promtool, "check", "metrics"], input=body,
                                      capture_output=True, timeout=30)
                assert lint.returncode == 0 and not lint.stdout.strip(), lint
            health = _health(port)
            seg = next(s for s in health["segments"] if s["segment_id"] == mem_id)
            assert seg["used"] == used and seg["free"] == 16 * MiB - used and seg["objects"] == 3
            assert health["transfer_server"]["served"] >= 9

        # the guard dies: the page says so until the daemon has started a new one
        guard_pid = health["guard"]["pid"]
        os.kill(guard_pid, signal.SIGKILL)

        def noticed() -> dict[str, Any] | None:
            h = _health(port)
            g = h["guard"]
            if not g["alive"] and g["pid"] == guard_pid:
                assert h["status"] == "degraded" and "guard" in h["problems"][0]
                assert _sum(_scrape(port), "kvpool_node_guard_alive") == 0
                return h
            if g["pid"] != guard_pid and g["respawns"] >= 1:  # already replaced
                assert _sum(_scrape(port), "kvpool_node_guard_respawns_total") >= 1
                return h
            return None

        wait_until(noticed, 10, "the guard's death on /health")
