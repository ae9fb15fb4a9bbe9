"""A node daemon's ``/metrics`` (Prometheus, ``kvpool_node_*``) and ``/health`` (JSON).

Everything is read at scrape time from what the daemon's client already
keeps: its transfer engine's counters (:mod:`kvpool.transfer.counters`:
transfers served by its transfer servers and made by its own batches, by
transport and op, with bytes and latency histograms), the capability
verifier's refusals, its segments (capacity here; bytes held, free and
objects as the master accounts them), the guard process, the SSD tier's file
I/O and tier tasks. The master's per-segment figures come from one
LIST_SEGMENTS on a stub of this module's own, at most once a second
(:class:`SegmentUsage`); with the master unreachable a scrape still answers,
with the last figures and their age. Series: docs/metrics.md.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvpool.core.capability import refusal_metrics
from kvpool.core.descriptors import SegmentInfo
from kvpool.core.http import JSON, PROMETHEUS, Route
from kvpool.core.prom import labelled_counter
from kvpool.core.protocol import ListSegments
from kvpool.store.client import Client
from kvpool.transfer.counters import LATENCY_BUCKETS_S

__all__ = ["NodeCollector", "NodeMetrics", "SegmentUsage"]

log = logging.getLogger(__name__)

_USAGE_MAX_AGE_S = 1.0  # scrapes closer together than this share one LIST_SEGMENTS
_USAGE_TIMEOUT_S = 1.0  # a scrape waits at most this long for the master
_BOUNDS = [str(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]


class SegmentUsage:
    """The master's view of this node's segments (bytes used, objects, state),
    fetched with LIST_SEGMENTS on a stub of its own when older than a second.
    ``close()`` closes the stub."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._stub: Any = None
        self._usage: dict[str, SegmentInfo] = {}
        self._at = 0.0  # monotonic time of the last answer (0: none yet)
        self._tried = 0.0
        self.error = ""  # why the last refresh failed ("" when it did not)

    def get(self) -> tuple[dict[str, SegmentInfo], float | None]:
        """(segment id -> its SegmentInfo, age in seconds of those figures;
        None when the master has not answered yet)."""
        with self._lock:
            now = time.monotonic()
            if now - self._tried >= _USAGE_MAX_AGE_S:
                self._tried = now
                self._refresh()
            age = time.monotonic() - self._at if self._at else None
            return self._usage, age

    def _refresh(self) -> None:
        from kvpool.store.guard import master_stub

        cfg = self._client.config
        own = set(self._client.segment_ids)
        try:
            if self._stub is None:
                self._stub = master_stub(cfg.master_address, cfg.rpc_timeout_s, cfg.curve,
                                         cfg.rpc_poll)
            reply = self._stub.call(ListSegments(), min(_USAGE_TIMEOUT_S, cfg.rpc_timeout_s))
        except Exception as exc:  # the page answers without the master
            self.error = f"{type(exc).__name__}: {exc}"
            log.debug("segment usage: %s", self.error)
            return
        self._usage = {s.descriptor.segment_id: s for s in reply.segments
                       if s.descriptor.segment_id in own}
        self._at = time.monotonic()
        self.error = ""

    def close(self) -> None:
        with self._lock:
            if self._stub is not None:
                self._stub.close()
                self._stub = None


class NodeCollector(Collector):
    """The ``kvpool_node_*`` families of one daemon (module docstring; the
    names and labels are listed in docs/metrics.md)."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        client = self.m.client
        engine = client.engine
        yield GaugeMetricFamily("kvpool_node_uptime_seconds", "seconds since the daemon started",
                                value=time.monotonic() - self.m.started)
        info = GaugeMetricFamily("kvpool_node_info", "1, labelled with the daemon's identity",
                                 labels=["client_id", "host_id", "endpoint"])
        info.add_metric([client.client_id, client.host_id, client.endpoint], 1)
        yield info
        yield from self._segments()
        yield from self._transfers(engine)
        yield from refusal_metrics(engine.capabilities)
        server = engine.server
        if server is not None:  # the segment server's range counters (also in its STATS)
            for name, value in (("served", server.requests_served),
                                ("refused", server.requests_refused)):
                yield CounterMetricFamily(f"kvpool_transfer_requests_{name}",
                                          f"transfer server requests (ranges) {name}",
                                          value=value)
        yield from self._guard()
        yield from self._ssd()

    def _segments(self) -> Iterator[Metric]:
        usage, age = self.m.usage.get()
        labels = ["segment", "kind"]
        cap = GaugeMetricFamily("kvpool_node_segment_capacity_bytes",
                                "bytes this node contributes, per segment", labels=labels)
        used = GaugeMetricFamily("kvpool_node_segment_used_bytes",
                                 "bytes held (allocated to objects) per segment, as the master "
                                 "accounts them", labels=labels)
        free = GaugeMetricFamily("kvpool_node_segment_free_bytes",
                                 "bytes free per segment, as the master accounts them",
                                 labels=labels)
        objects = GaugeMetricFamily("kvpool_node_segment_objects",
                                    "replicas held per segment, as the master accounts them",
                                    labels=labels)
        for seg in self.m.local_segments():
            values = [seg.segment_id, seg.kind.name.lower()]
            cap.add_metric(values, seg.size)
            u = usage.get(seg.segment_id)
            if u is not None:
                used.add_metric(values, u.used)
                free.add_metric(values, max(0, u.capacity - u.used))
                objects.add_metric(values, u.objects)
        yield cap
        yield used
        yield free
        yield objects
        if age is not None:
            yield GaugeMetricFamily("kvpool_node_segment_usage_age_seconds",
                                    "age of the master's per-segment figures above",
                                    value=age)
        yield GaugeMetricFamily("kvpool_node_master_reachable",
                                "1 if the master answered this scrape's (or the last "
                                "second's) LIST_SEGMENTS", value=0 if self.m.usage.error else 1)

    def _transfers(self, engine: Any) -> Iterator[Metric]:
        labels = ["direction", "transport", "op"]
        reqs = CounterMetricFamily("kvpool_node_transfer_requests",
                                   "transfer requests (ranges): served by this node's "
                                   "transfer servers, made by its client", labels=labels)
        nbytes = CounterMetricFamily("kvpool_node_transfer_bytes",
                                     "bytes of those requests", labels=labels)
        hist = HistogramMetricFamily("kvpool_node_transfer_seconds",
                                     "latency: of a request frame served, of a batch slice "
                                     "made", labels=labels)
        for c in engine.counters.snapshot():
            values = [c.direction.value, c.transport, c.op.name.lower()]
            reqs.add_metric(values, c.requests)
            nbytes.add_metric(values, c.bytes)
            hist.add_metric(values, list(zip(_BOUNDS, c.buckets, strict=True)), c.sum_s)
        yield reqs
        yield nbytes
        yield hist
        counters = engine.counters
        yield labelled_counter("kvpool_node_transfer_failures",
                               "requests whose attempt on a transport failed (made)",
                               ["transport"],
                               (([t], n) for t, n in list(counters.failures.items())))
        yield labelled_counter("kvpool_node_transfer_failovers",
                               "requests moved from a transport to the next one (made)",
                               ["transport"],
                               (([t], n) for t, n in list(counters.failovers.items())))

    def _guard(self) -> Iterator[Metric]:
        host = self.m.client.segment_host
        g = self.m.guard_state()
        if g["enabled"]:
            yield GaugeMetricFamily("kvpool_node_guard_alive",
                                    "1 while the segment guard process runs",
                                    value=1 if g["alive"] else 0)
            yield GaugeMetricFamily("kvpool_node_guard_ready",
                                    "1 once the running guard answered ready",
                                    value=1 if g["ready"] else 0)
        yield CounterMetricFamily("kvpool_node_guard_respawns",
                                  "guard processes replaced after one died or stayed silent",
                                  value=host.guard_respawns)
        yield CounterMetricFamily("kvpool_node_orphans_reaped",
                                  "shared-memory segments of dead processes removed here",
                                  value=host.orphans_reaped)
        yield CounterMetricFamily("kvpool_node_remounts",
                                  "re-mounts of the segments the master asked for",
                                  value=host.remounts)

    def _ssd(self) -> Iterator[Metric]:
        labels = ["segment", "op"]
        ops = CounterMetricFamily("kvpool_node_ssd_ops",
                                  "reads and writes of this node's SSD-tier segment files",
                                  labels=labels)
        nbytes = CounterMetricFamily("kvpool_node_ssd_bytes",
                                     "bytes read and written in this node's SSD-tier segment "
                                     "files", labels=labels)
        for seg in self.m.local_segments():
            io = getattr(seg, "io", None)
            if io is None:
                continue
            ops.add_metric([seg.segment_id, "read"], io.reads)
            ops.add_metric([seg.segment_id, "write"], io.writes)
            nbytes.add_metric([seg.segment_id, "read"], io.read_bytes)
            nbytes.add_metric([seg.segment_id, "write"], io.write_bytes)
        yield ops
        yield nbytes
        runner = self.m.client.segment_host.tier_runner
        if runner is not None:
            yield labelled_counter("kvpool_node_tier_tasks",
                                   "SSD-tier copy tasks run, by kind and result",
                                   ["kind", "result"],
                                   (([kind, "done" if ok else "failed"], n)
                                    for (kind, ok), n in list(runner.by_kind.items())))
            yield labelled_counter("kvpool_node_tier_task_bytes",
                                   "bytes copied by SSD-tier tasks done", ["kind"],
                                   (([k], n) for k, n in list(runner.bytes_by_kind.items())))
            yield GaugeMetricFamily("kvpool_node_tier_tasks_pending",
                                    "SSD-tier copy tasks queued here", value=runner.pending())


class NodeMetrics:
    """The daemon's HTTP routes (``/metrics``, ``/health``) over ``client``.
    ``info``: the daemon's ready info (part of ``/health``). ``close()``
    closes the master stub it reads segment usage with."""

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.started = time.monotonic()
        self.usage = SegmentUsage(client)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(self))

    def local_segments(self) -> list[Any]:
        """The segments this node owns (MemorySegment / FileSegment)."""
        return list(self.client.segment_host.segments)

    def guard_state(self) -> dict[str, Any]:
        """``{enabled, pid, alive, ready, respawns}`` of the segment guard.
        ``enabled``: the config asks for one and this node owns segments."""
        host = self.client.segment_host
        cfg = self.client.config
        enabled = bool(cfg.guard and host.segments)
        guard = host.guard
        alive = ready = False
        if guard is not None:
            alive = guard.alive()
            ready = alive and guard.is_ready
        return {"enabled": enabled, "pid": guard.pid if guard is not None else None,
                "alive": alive, "ready": ready, "respawns": host.guard_respawns}

    def health(self) -> dict[str, Any]:
        """The ``/health`` document: ``status`` ("ok"; "degraded" while an
        enabled guard is not running or the master did not answer), the
        ready info, uptime, guard, segments with the master's figures, and
        the transfer server's counters."""
        usage, age = self.usage.get()
        segments = []
        for seg in self.local_segments():
            u = usage.get(seg.segment_id)
            entry: dict[str, Any] = {"segment_id": seg.segment_id,
                                     "kind": seg.kind.name.lower(), "capacity": seg.size}
            if u is not None:
                entry.update(used=u.used, free=max(0, u.capacity - u.used), objects=u.objects,
                             state=u.state)
            segments.append(entry)
        guard = self.guard_state()
        problems = []
        if guard["enabled"] and not guard["alive"]:
            problems.append("guard process not running")
        if self.usage.error:
            problems.append(f"master: {self.usage.error}")
        server = self.client.engine.server
        out: dict[str, Any] = {
            "status": "degraded" if problems else "ok",
            "problems": problems,
            **self.info,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "guard": guard,
            "segments": segments,
            "usage_age_s": None if age is None else round(age, 3),
            "transfer_server": None if server is None else {
                "endpoint": server.endpoint,
                "bulk_port": server.bulk.port if server.bulk is not None else 0,
                "served": server.requests_served, "refused": server.requests_refused},
        }
        return out

    def routes(self) -> dict[str, Route]:
        return {"/metrics": lambda: (200, generate_latest(self.registry), PROMETHEUS),
                "/health": lambda: (200, json.dumps(self.health()), JSON)}

    def close(self) -> None:
        self.usage.close()
