"""Admin HTTP for the master: ``/metrics`` (Prometheus), ``/health`` (JSON) and
``/get_all_segments`` (Mooncake's admin route).

Metrics are built at scrape time from one :class:`~kvpool.master.stats.MasterStats`
snapshot the server hands out (``stats_snapshot()``); nothing here reads the
directory or the server's internals, and the loop never locks for a scrape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.core.http import JSON, PROMETHEUS, TEXT, Route
from kvpool.core.prom import labelled_counter
from kvpool.master.ha.sink import SinkState
from kvpool.master.stats import HaStats, MasterStats, copy_retrying

__all__ = ["MasterCollector", "StatsSource", "make_registry", "make_routes"]

_HA_ROLES = ("leader", "follower")


class StatsSource(Protocol):
    """What the admin endpoints read: a counter snapshot and the health map."""

    def stats_snapshot(self) -> MasterStats: ...

    def health(self) -> dict[str, Any]: ...


_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily

#: (family, name, help, StatsReply field, scale): the master's one-value metrics
_HEAD = (
    (_GAUGE, "kvpool_master_objects", "complete objects in the directory", "objects", 1),
    (_GAUGE, "kvpool_master_pending_puts", "in-flight puts", "pending", 1),
    (_GAUGE, "kvpool_master_clients", "live clients", "clients", 1),
)
_DIRECTORY = (
    (_COUNTER, "kvpool_master_evictions", "objects evicted", "evictions", 1),
    (_COUNTER, "kvpool_master_evicted_bytes", "bytes freed by eviction", "evicted_bytes", 1),
    (_COUNTER, "kvpool_master_lease_refusals", "removes refused: object leased",
     "lease_refusals", 1),
    (_COUNTER, "kvpool_master_expired_clients", "clients dropped for silence",
     "expired_clients", 1),
    (_GAUGE, "kvpool_master_suspect_clients",
     "clients silent past client_ttl, kept for the grace period", "suspect_clients", 1),
    (_GAUGE, "kvpool_master_suspect_segments",
     "segments of suspect clients: objects kept, no new placements", "suspect_segments", 1),
    (_COUNTER, "kvpool_master_suspected_clients", "times a client became suspect",
     "suspected_clients", 1),
    (_COUNTER, "kvpool_master_revived_clients",
     "times a suspect client came back with its segments", "revived_clients", 1),
    (_COUNTER, "kvpool_master_replaced_objects", "objects replaced by an upsert", "replaced", 1),
    (_GAUGE, "kvpool_master_soft_pinned_objects",
     "objects with a soft pin deadline (some may have passed it)", "soft_pinned", 1),
    (_GAUGE, "kvpool_master_object_groups", "object groups with members", "groups", 1),
    (_GAUGE, "kvpool_master_restore_unloaded_objects",
     "objects of the restored snapshot not made yet (served meanwhile: a request loads its "
     "keys' shards first)", "restore_unloaded", 1),
    (_GAUGE, "kvpool_master_held_bytes",
     "bytes of removed or abandoned objects held until their read leases or write grants end "
     "(counted as used)", "held_bytes", 1),
)
#: (name, help, key of StatsReply.tiering) of the SSD tier's gauges
_TIER = (
    ("kvpool_master_tier_tasks_inflight", "tier copy tasks in flight", "tier_tasks_inflight"),
    ("kvpool_master_tier_inflight_bytes", "bytes of tier tasks in flight",
     "tier_inflight_bytes"),
    ("kvpool_master_file_segments_awaiting",
     "file segments kept for an owner that left (warm restart)", "file_segments_awaiting"),
)
_TIER_GAUGES = tuple(key for _n, _h, key in _TIER)
_LOOP = (
    (_COUNTER, "kvpool_master_curve_denied", "CURVE handshakes refused by the ZAP allow-list",
     "curve_denied", 1),
    (_COUNTER, "kvpool_master_snapshots", "snapshots written", "snapshots", 1),
    (_GAUGE, "kvpool_master_snapshot_duration_seconds",
     "duration of the last snapshot (child, wall)", "last_snapshot_duration_s", 1),
    (_GAUGE, "kvpool_master_snapshot_pause_seconds", "loop pause to start the last snapshot",
     "last_snapshot_pause_ms", 1000),
    (_GAUGE, "kvpool_master_max_loop_seconds", "longest loop iteration", "max_loop_ms", 1000),
    (_GAUGE, "kvpool_master_restore_seconds",
     "the last restart's restore until serving began", "restore_s", 1),
)
#: (family, name, help, HaStats field) of every HA instance (bools as 0/1)
_HA = (
    (_GAUGE, "kvpool_master_ha_fenced",
     "1 while elected but past the fencing deadline (lease unconfirmed: writes refused, "
     "mutating timers paused)", "fenced"),
    (_GAUGE, "kvpool_master_ha_writes_refused",
     "1 while serving but refusing writes (fenced, or fewer in-sync standbys than "
     "sync_standbys for sync_timeout_s)", "writes_refused"),
    (_GAUGE, "kvpool_master_ha_eligible",
     "1 if this instance may be elected (in the in-sync set)", "eligible"),
    (_GAUGE, "kvpool_master_ha_epoch", "epoch of the term this instance knows of", "epoch"),
    (_GAUGE, "kvpool_master_ha_lsn", "last journal position this instance holds", "lsn"),
    (_COUNTER, "kvpool_master_ha_promotions", "times this instance became leader",
     "promotions"),
    (_COUNTER, "kvpool_master_ha_demotions", "times this instance was deposed", "demotions"),
)
_HA_LEADER = (
    (_GAUGE, "kvpool_master_ha_acked_lsn",
     "leader: last position every in-sync standby holds", "acked_lsn"),
    (_GAUGE, "kvpool_master_ha_in_sync_standbys", "leader: standbys in the in-sync set",
     "in_sync"),
)


def _scalars(table: Any, src: Any) -> Iterator[Metric]:
    """The one-value metrics of ``table`` read from ``src`` (scaled down)."""
    for family, name, text, field, scale in table:
        value = getattr(src, field)
        yield family(name, text, value=value / scale if scale != 1 else value)


class MasterCollector(Collector):
    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        snap = self.source.stats_snapshot()
        st = snap.stats
        yield from _scalars(_HEAD, st)
        used = GaugeMetricFamily("kvpool_master_segment_used_bytes", "bytes allocated per segment",
                                 labels=["segment", "kind", "state"])
        cap = GaugeMetricFamily("kvpool_master_segment_capacity_bytes", "capacity per segment",
                                labels=["segment", "kind", "state"])
        frag = GaugeMetricFamily("kvpool_master_segment_fragmentation",
                                 "1 - largest free block / free bytes", labels=["segment"])
        for seg in snap.segments:
            desc = seg.descriptor
            labels = [desc.segment_id, desc.kind.name.lower(), seg.state]
            used.add_metric(labels, seg.used)
            cap.add_metric(labels, seg.capacity)
            frag.add_metric([desc.segment_id], seg.fragmentation)
        yield used
        yield cap
        yield frag
        for name, text, mem, file in (
                ("kvpool_master_pool_used_bytes", "bytes used per pool", st.memory_used,
                 st.file_used),
                ("kvpool_master_pool_capacity_bytes", "capacity per pool", st.memory_capacity,
                 st.file_capacity)):
            pool = GaugeMetricFamily(name, text, labels=["kind"])
            pool.add_metric(["memory"], mem)
            pool.add_metric(["file"], file)
            yield pool
        yield labelled_counter("kvpool_master_requests", "requests by op", ["op"],
                               (([op.lower()], n) for op, n in snap.ops.items()))
        yield labelled_counter("kvpool_master_key_ops", "per-key operations (batch items count)",
                               ["op"], (([op.lower()], n) for op, n in snap.key_ops.items()))
        yield labelled_counter("kvpool_master_errors", "error results by op and code",
                               ["op", "code"],
                               (([op.lower(), code], n) for (op, code), n in snap.errors.items()))
        yield from _scalars(_DIRECTORY, st)
        tier = st.tiering  # SSD tier
        yield labelled_counter("kvpool_master_tier_events",
                               "SSD tier: copy tasks and file segments, by event", ["event"],
                               (([name], n) for name, n in tier.items()
                                if name not in _TIER_GAUGES))
        for name, text, key in _TIER:
            yield GaugeMetricFamily(name, text, value=tier.get(key, 0))
        yield from _scalars(_LOOP, st)
        if snap.ha is not None:
            yield from _ha_metrics(snap.ha)
        if snap.tenants:
            yield from _tenant_metrics(snap.tenants)
        ev = snap.events  # object events (docs/events.md); absent when off
        if ev:
            yield CounterMetricFamily("kvpool_master_events_batches", "event batches published",
                                      value=ev["batches"])
            yield CounterMetricFamily("kvpool_master_events", "object and segment events published",
                                      value=ev["events"])
            yield CounterMetricFamily(
                "kvpool_master_events_dropped",
                "event batches a subscriber's full queue refused (each starts a run of "
                "messages that subscriber misses; it sees the seq gap and resyncs)",
                value=ev["overflows"])
            yield GaugeMetricFamily("kvpool_master_events_seq", "seq of the last event batch",
                                    value=ev["seq"])
            yield CounterMetricFamily(
                "kvpool_master_events_subscriptions_refused",
                "subscriptions refused under tenant_keys (a topic the subscriber's CURVE key "
                "may not follow)", value=ev.get("refused", 0))


#: (name, help, row field) of the per-tenant counters
_TENANT_COUNTERS = (
    ("kvpool_master_tenant_hits", "replica lists and exists that found the object", "hits"),
    ("kvpool_master_tenant_misses", "replica lists and exists that did not", "misses"),
    ("kvpool_master_tenant_evictions", "objects evicted (pool pressure or the tenant's quota)",
     "evictions"),
    ("kvpool_master_tenant_refusals", "puts refused with QUOTA_EXCEEDED", "refusals"),
)


def _tenant_metrics(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-tenant series, label ``tenant`` (docs/tenants.md); a quota
    of -1 (unlimited) and bytes not counted (None) are left out."""
    used = GaugeMetricFamily("kvpool_master_tenant_used_bytes",
                             "bytes of object data per tenant and tier (size x replicas)",
                             labels=["tenant", "kind"])
    quota = GaugeMetricFamily("kvpool_master_tenant_quota_bytes",
                              "quota per tenant and kind (memory, disk, guaranteed)",
                              labels=["tenant", "kind"])
    objects = GaugeMetricFamily("kvpool_master_tenant_objects", "complete objects per tenant",
                                labels=["tenant"])
    for r in rows:
        name = r["name"]
        for kind, field in (("memory", "memory_used"), ("disk", "disk_used")):
            if r[field] is not None:
                used.add_metric([name, kind], r[field])
        for kind, field in (("memory", "memory_quota"), ("disk", "disk_quota"),
                            ("guaranteed", "guaranteed")):
            if r[field] >= 0:
                quota.add_metric([name, kind], r[field])
        objects.add_metric([name], r["objects"])
    yield used
    yield quota
    yield objects
    for name, text, field in _TENANT_COUNTERS:
        yield labelled_counter(name, text, ["tenant"], (([r["name"]], r[field]) for r in rows))


def _ha_metrics(ha: HaStats) -> Iterator[Metric]:
    """Gauges of an HA instance (docs/ha.md): the same values as ``/health``."""
    g = GaugeMetricFamily("kvpool_master_ha_role",
                          "1 for this instance's role in its HA group, 0 for the others",
                          labels=["role"])
    for role in _HA_ROLES:
        g.add_metric([role], 1 if ha.role == role else 0)
    yield g
    for family, name, text, field in _HA:
        yield family(name, text, value=int(getattr(ha, field)))
    if ha.acked_lsn is not None:  # leader
        for family, name, text, field in _HA_LEADER:
            yield family(name, text, value=getattr(ha, field) or 0)
        lag = GaugeMetricFamily("kvpool_master_ha_standby_lag",
                                "leader: records a standby has not acknowledged",
                                labels=["standby", "state"])
        acked = GaugeMetricFamily("kvpool_master_ha_standby_acked_lsn",
                                  "leader: last position a standby acknowledged",
                                  labels=["standby"])
        in_sync = GaugeMetricFamily("kvpool_master_ha_standby_in_sync",
                                    "leader: 1 if the standby is in the in-sync set",
                                    labels=["standby"])
        for sb in ha.standbys:
            lag.add_metric([sb.instance_id, sb.state], sb.lag)
            acked.add_metric([sb.instance_id], sb.acked_lsn)
            in_sync.add_metric([sb.instance_id], 1 if sb.in_sync else 0)
        yield lag
        yield acked
        yield in_sync
    if ha.applied_lsn is not None:  # follower
        yield GaugeMetricFamily("kvpool_master_ha_applied_lsn",
                                "follower: last position applied from the leader's stream",
                                value=ha.applied_lsn)
        g = GaugeMetricFamily("kvpool_master_ha_sink_state",
                              "follower: 1 for the state of its replication stream",
                              labels=["state"])
        for state in SinkState:
            g.add_metric([state.value], 1 if ha.sink == state.value else 0)
        yield g


def make_registry(server: StatsSource) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MasterCollector(server))
    return registry


def make_routes(server: StatsSource, registry: CollectorRegistry) -> dict[str, Route]:
    """The master's HTTP routes: ``/metrics``, ``/health`` (JSON), and
    ``/get_all_segments`` (Mooncake's admin route: SGLang's check_server polls
    it; the mounted segments, one name per line, empty while there are none)."""

    def segments() -> tuple[int, str, str]:
        segs = server.stats_snapshot().segments
        return 200, "".join(f"{s.descriptor.segment_id}\n" for s in segs
                            if s.state == "active"), TEXT

    return {"/metrics": lambda: (200, generate_latest(registry), PROMETHEUS),
            "/health": lambda: (200, json.dumps(copy_retrying(server.health)), JSON),
            "/get_all_segments": segments}
