"""Admin HTTP for the master: ``/metrics`` (Prometheus) and ``/health`` (JSON).

Metrics are collected at scrape time from the server's plain counters (no
locking on the hot path); the scrape runs on the HTTP thread and copies
what it reads, retrying if the loop resized a dict meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvpool.master.server import MasterServer

__all__ = ["MasterCollector", "make_handler", "make_registry"]


def _copy(fn: Any) -> Any:
    """Run ``fn`` (reading loop-owned state from the HTTP thread), retrying if
    the loop changed a container under it."""
    for _ in range(10):
        try:
            return fn()
        except (RuntimeError, IndexError, KeyError):  # e.g. dict changed size
            continue
    return fn()


class MasterCollector(Collector):
    def __init__(self, server: MasterServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = self.server
        d = s.dir
        st = _copy(d.stats)
        g = GaugeMetricFamily("kvpool_master_objects", "complete objects in the directory")
        g.add_metric([], st["objects"])
        yield g
        g = GaugeMetricFamily("kvpool_master_pending_puts", "in-flight puts")
        g.add_metric([], st["pending"])
        yield g
        g = GaugeMetricFamily("kvpool_master_clients", "live clients")
        g.add_metric([], st["clients"])
        yield g
        used = GaugeMetricFamily("kvpool_master_segment_used_bytes", "bytes allocated per segment",
                                 labels=["segment", "kind", "state"])
        cap = GaugeMetricFamily("kvpool_master_segment_capacity_bytes", "capacity per segment",
                                labels=["segment", "kind", "state"])
        frag = GaugeMetricFamily("kvpool_master_segment_fragmentation",
                                 "1 - largest free block / free bytes", labels=["segment"])
        for seg in _copy(lambda: list(d.segments.values())):
            labels = [seg.id, seg.kind.name.lower(), seg.state.name.lower()]
            used.add_metric(labels, seg.alloc.used)
            cap.add_metric(labels, seg.alloc.capacity)
            frag.add_metric([seg.id], _copy(seg.alloc.fragmentation))
        yield used
        yield cap
        yield frag
        pool = GaugeMetricFamily("kvpool_master_pool_used_bytes", "bytes used per pool",
                                 labels=["kind"])
        pool.add_metric(["memory"], st["memory_used"])
        pool.add_metric(["file"], st["file_used"])
        yield pool
        pool = GaugeMetricFamily("kvpool_master_pool_capacity_bytes", "capacity per pool",
                                 labels=["kind"])
        pool.add_metric(["memory"], st["memory_capacity"])
        pool.add_metric(["file"], st["file_capacity"])
        yield pool
        c = CounterMetricFamily("kvpool_master_requests", "requests by op", labels=["op"])
        for op, n in _copy(lambda: list(s.ops.items())):
            c.add_metric([op.lower()], n)
        yield c
        c = CounterMetricFamily("kvpool_master_key_ops", "per-key operations (batch items count)",
                                labels=["op"])
        for op, n in _copy(lambda: list(s.key_ops.items())):
            c.add_metric([op.lower()], n)
        yield c
        c = CounterMetricFamily("kvpool_master_errors", "error results by op and code",
                                labels=["op", "code"])
        for (op, code), n in _copy(lambda: list(s.errors.items())):
            c.add_metric([op.lower(), code], n)
        yield c
        c = CounterMetricFamily("kvpool_master_evictions", "objects evicted")
        c.add_metric([], st["evictions"])
        yield c
        c = CounterMetricFamily("kvpool_master_evicted_bytes", "bytes freed by eviction")
        c.add_metric([], st["evicted_bytes"])
        yield c
        c = CounterMetricFamily("kvpool_master_lease_refusals", "removes refused: object leased")
        c.add_metric([], st["lease_refusals"])
        yield c
        c = CounterMetricFamily("kvpool_master_expired_clients", "clients dropped for silence")
        c.add_metric([], st["expired_clients"])
        yield c
        tier = _copy(s.tiering.stats)  # SSD tier (issue 5)
        c = CounterMetricFamily("kvpool_master_tier_events",
                                "SSD tier: copy tasks and file segments, by event",
                                labels=["event"])
        for name, n in tier.items():
            if name not in ("tier_tasks_inflight", "tier_inflight_bytes",
                            "file_segments_awaiting"):
                c.add_metric([name], n)
        yield c
        g = GaugeMetricFamily("kvpool_master_tier_tasks_inflight", "tier copy tasks in flight")
        g.add_metric([], tier["tier_tasks_inflight"])
        yield g
        g = GaugeMetricFamily("kvpool_master_tier_inflight_bytes", "bytes of tier tasks in flight")
        g.add_metric([], tier["tier_inflight_bytes"])
        yield g
        g = GaugeMetricFamily("kvpool_master_file_segments_awaiting",
                              "file segments kept for an owner that left (warm restart)")
        g.add_metric([], tier["file_segments_awaiting"])
        yield g
        c = CounterMetricFamily("kvpool_master_curve_denied",
                                "CURVE handshakes refused by the ZAP allow-list")
        c.add_metric([], s._auth.denied if s._auth is not None else 0)
        yield c
        c = CounterMetricFamily("kvpool_master_snapshots", "snapshots written")
        c.add_metric([], s.snapshot_count)
        yield c
        g = GaugeMetricFamily("kvpool_master_snapshot_duration_seconds",
                              "duration of the last snapshot (child, wall)")
        g.add_metric([], s.last_snapshot_duration_s)
        yield g
        g = GaugeMetricFamily("kvpool_master_snapshot_pause_seconds",
                              "loop pause to start the last snapshot")
        g.add_metric([], s.last_snapshot_pause_ms / 1000)
        yield g
        g = GaugeMetricFamily("kvpool_master_max_loop_seconds", "longest loop iteration")
        g.add_metric([], s.max_loop_ms / 1000)
        yield g


def make_registry(server: MasterServer) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MasterCollector(server))
    return registry


def make_handler(server: MasterServer, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            elif path == "/health":
                self._send(200, json.dumps(_copy(server.health)).encode(), "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
