# ruff: noqa: E501  # one query per line: each can be pasted into Prometheus as it is
"""Build deploy/grafana/kvpool.json, the kvpool Grafana dashboard.

Edit the panels here, then run ``python deploy/grafana/build_dashboard.py``
(``--check`` exits 1 when the JSON differs from what this builds; the test
tests/deploy/test_prometheus.py runs it so). Every query is checked against
a live pool by that test; docs/operations.md describes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["build", "main"]

OUT = Path(__file__).with_name("kvpool.json")
DS = {"type": "prometheus", "uid": "${datasource}"}  # the data source variable
GRID_W = 24


class _Layout:
    """Panels placed left to right on Grafana's 24-column grid, rows between."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = 0
        self.line_h = 0  # height of the line being filled
        self.next_id = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def end_line(self) -> None:
        """Start a new line below the panels placed so far."""
        if self.x:
            self.y += self.line_h
            self.x = 0

    def row(self, title: str, collapsed: bool = False) -> None:
        self.end_line()
        self.panels.append({"type": "row", "title": title, "id": self._id(),
                            "collapsed": collapsed, "panels": [],
                            "gridPos": {"h": 1, "w": GRID_W, "x": 0, "y": self.y}})
        self.y += 1

    def panel(self, title: str, targets: list[tuple[str, str]], unit: str = "short",
              desc: str = "", kind: str = "timeseries", w: int = 8, h: int = 8,
              extra: dict[str, Any] | None = None) -> None:
        """A panel of ``targets`` (PromQL expression, legend) in the next free place."""
        if self.x + w > GRID_W:
            self.end_line()
        options: dict[str, Any]
        if kind == "timeseries":
            options = {"legend": {"displayMode": "list", "placement": "bottom",
                                  "showLegend": True},
                       "tooltip": {"mode": "multi", "sort": "desc"}}
        else:
            options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                         "values": False},
                       "colorMode": "value", "graphMode": "area", "textMode": "auto"}
        p: dict[str, Any] = {
            "type": kind, "title": title, "id": self._id(), "datasource": DS,
            "description": desc, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": options,
            "targets": [{"datasource": DS, "refId": chr(65 + i), "expr": expr,
                         "legendFormat": legend, "range": True}
                        for i, (expr, legend) in enumerate(targets)]}
        if extra:
            p.update(extra)
        self.panels.append(p)
        self.line_h = h if self.x == 0 else max(self.line_h, h)
        self.x += w


def _custom(name: str, label: str, value: str) -> dict[str, Any]:
    return {"type": "custom", "name": name, "label": label, "query": value,
            "current": {"selected": True, "text": value, "value": value},
            "options": [{"selected": True, "text": value, "value": value}], "hide": 0}


def _label_values(name: str, metric: str, label: str) -> dict[str, Any]:
    query = f'label_values({metric}{{job=~"$master_job"}}, {label})'
    return {"type": "query", "name": name, "label": label, "datasource": DS,
            "definition": query, "query": {"query": query, "refId": name},
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0, "options": []}


def _panels(b: _Layout) -> None:
    M = 'job=~"$master_job"'
    N = 'job=~"$node_job"'
    V = 'job=~"$vllm_job"'
    R = "$__rate_interval"
    GET = f'{M}, op="get_replica_list"'

    b.row("Overview")
    b.panel("Memory pool used", [
        (f'max(kvpool_master_pool_used_bytes{{{M}, kind="memory"}}) / max(kvpool_master_pool_capacity_bytes{{{M}, kind="memory"}} > 0)', "memory")],
        "percentunit", "Memory tier used / capacity.", kind="stat", w=4, h=4)
    b.panel("Objects now", [
        (f"max(kvpool_master_objects{{{M}}})", "objects")],
        "short", "Complete objects in the directory.", kind="stat", w=4, h=4)
    b.panel("Lookup hit rate", [
        (f'1 - (sum(rate(kvpool_master_errors_total{{{GET}, code="OBJECT_NOT_FOUND"}}[5m])) or vector(0)) / sum(rate(kvpool_master_key_ops_total{{{GET}}}[5m]))', "hit rate")],
        "percentunit", "Key lookups that found the object, last 5 minutes.", kind="stat", w=4, h=4)
    b.panel("Nodes up", [
        (f"sum(up{{{N}}})", "up"), (f"count(up{{{N}}})", "scraped")],
        "short", "Node daemon targets answering / configured.", kind="stat", w=4, h=4)
    b.panel("Masters up / leaders", [
        (f"sum(up{{{M}}})", "masters up"),
        (f'sum(kvpool_master_ha_role{{{M}, role="leader"}})', "leaders")],
        "short", "Master targets answering, and how many report leader (HA: exactly 1).", kind="stat", w=4, h=4)
    b.panel("Suspect clients", [
        (f"max(kvpool_master_suspect_clients{{{M}}})", "suspect")],
        "short", "Clients silent past client_ttl_s (KvpoolSuspectClients).", kind="stat", w=4, h=4)

    b.row("Pool")
    b.panel("Pool used / capacity by tier", [
        (f"max by (kind) (kvpool_master_pool_used_bytes{{{M}}})", "used {{kind}}"),
        (f"max by (kind) (kvpool_master_pool_capacity_bytes{{{M}}})", "capacity {{kind}}"),
        (f"max(kvpool_master_held_bytes{{{M}}})", "held (removed, still leased)")],
        "bytes", "Bytes allocated and contributed per tier (memory = shared-memory segments, file = SSD tier). Held: bytes of removed or abandoned objects kept (and counted as used) until their read leases or write grants end. Max over master instances: a standby reports 0.")
    b.panel("Pool usage by tier", [
        (f"max by (kind) (kvpool_master_pool_used_bytes{{{M}}}) / max by (kind) (kvpool_master_pool_capacity_bytes{{{M}}} > 0)", "{{kind}}")],
        "percentunit", "Used / capacity per tier. Eviction starts at eviction_high_watermark (0.9 by default); KvpoolPoolNearlyFull fires above 0.95.",
        extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1}, "overrides": []}})
    b.panel("Segments by tier and state", [
        (f"count by (kind, state) (kvpool_master_segment_capacity_bytes{{{M}}})", "{{kind}} {{state}}")],
        "short", "Mounted segments: active, or kept for a suspect client (no new placements).")
    b.panel("Segment usage", [
        (f'max by (segment, kind) (kvpool_master_segment_used_bytes{{{M}, segment=~"$segment"}}) / max by (segment, kind) (kvpool_master_segment_capacity_bytes{{{M}, segment=~"$segment"}} > 0)', "{{segment}} ({{kind}})")],
        "percentunit", "Used / capacity per segment (node).")
    b.panel("Segment used bytes", [
        (f'max by (segment, kind) (kvpool_master_segment_used_bytes{{{M}, segment=~"$segment"}})', "{{segment}} ({{kind}})")],
        "bytes", "Bytes allocated per segment.")
    b.panel("Segment fragmentation", [
        (f'max by (segment) (kvpool_master_segment_fragmentation{{{M}, segment=~"$segment"}})', "{{segment}}")],
        "percentunit", "1 - largest free block / free bytes: near 1, large objects no longer fit although bytes are free.")

    b.row("Objects and traffic")
    b.panel("Objects", [
        (f"max(kvpool_master_objects{{{M}}})", "objects"),
        (f"max(kvpool_master_pending_puts{{{M}}})", "pending puts"),
        (f"max(kvpool_master_soft_pinned_objects{{{M}}})", "soft pinned"),
        (f"max(kvpool_master_object_groups{{{M}}})", "object groups"),
        (f"max(kvpool_master_restore_unloaded_objects{{{M}}})", "restored, not loaded yet")],
        "short", "Complete objects in the directory, puts in flight, soft-pinned objects, object groups. After a restart the master serves at once and loads its snapshot's objects in the background: the last series counts those not loaded yet.")
    b.panel("Hit rate", [
        (f'1 - (sum(rate(kvpool_master_errors_total{{{GET}, code="OBJECT_NOT_FOUND"}}[{R}])) or vector(0)) / sum(rate(kvpool_master_key_ops_total{{{GET}}}[{R}]))', "hit rate")],
        "percentunit", "Share of key lookups (get_replica_list, single and batch items) that found the object. The vLLM row shows the token hit rate.",
        extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1}, "overrides": []}})
    b.panel("Put / get rate (keys)", [
        (f'sum(rate(kvpool_master_key_ops_total{{{M}, op="put_end"}}[{R}]))', "puts completed"),
        (f'sum(rate(kvpool_master_key_ops_total{{{M}, op=~"put_start|upsert_start|reserve"}}[{R}]))', "puts started"),
        (f'sum(rate(kvpool_master_key_ops_total{{{GET}}}[{R}]))', "gets (lookups)")],
        "ops", "Per-key operations per second at the master (batch items counted one by one).")
    b.panel("Master requests by op", [
        (f"sum by (op) (rate(kvpool_master_requests_total{{{M}}}[{R}]))", "{{op}}")],
        "reqps", "RPC requests per second by op (a batch counts once).")
    b.panel("Master errors by op and code", [
        (f"sum by (op, code) (rate(kvpool_master_errors_total{{{M}}}[{R}]))", "{{op}} {{code}}")],
        "ops", "Error results per second. OBJECT_NOT_FOUND on get_replica_list is a cache miss; NO_AVAILABLE_HANDLE on puts means no space.")
    b.panel("Master loop and snapshots", [
        (f"max by (instance) (kvpool_master_max_loop_seconds{{{M}}})", "longest loop iteration {{instance}}"),
        (f"max by (instance) (kvpool_master_snapshot_pause_seconds{{{M}}})", "last snapshot pause {{instance}}"),
        (f"max by (instance) (kvpool_master_snapshot_duration_seconds{{{M}}})", "last snapshot duration {{instance}}"),
        (f"max by (instance) (kvpool_master_restore_seconds{{{M}}})", "last restore until serving {{instance}}")],
        "s", "The master has no per-request latency histograms: the longest event-loop iteration bounds the time a request waits in the master. Snapshot pause: loop stop to fork a snapshot. Restore: from the start of the last restart's restore until it served.")

    b.row("Evictions and SSD tier")
    b.panel("Evictions", [
        (f"sum(rate(kvpool_master_evictions_total{{{M}}}[{R}]))", "objects/s")],
        "ops", "Objects evicted per second (KvpoolEvictionStorm: more than half the capacity every 5 minutes).")
    b.panel("Evicted bytes", [
        (f"sum(rate(kvpool_master_evicted_bytes_total{{{M}}}[{R}]))", "evicted"),
        (f"sum(rate(kvpool_master_replaced_objects_total{{{M}}}[{R}]))", "objects replaced by upsert /s")],
        "Bps", "Bytes freed by eviction per second.")
    b.panel("SSD tier", [
        (f"sum by (event) (rate(kvpool_master_tier_events_total{{{M}}}[{R}]))", "{{event}}"),
        (f"max(kvpool_master_tier_tasks_inflight{{{M}}})", "tasks in flight"),
        (f"max(kvpool_master_file_segments_awaiting{{{M}}})", "file segments awaiting their owner")],
        "short", "Offloads to the SSD tier, promotions back, their failures; copy tasks in flight.")

    b.row("Transfers and node daemons")
    b.panel("Transfers by transport", [
        (f"sum by (direction, transport) (rate(kvpool_node_transfer_requests_total{{{N}}}[{R}]))", "{{direction}} {{transport}}")],
        "reqps", "Transfer requests (byte ranges) per second: served by the nodes' transfer servers, made by the daemons' own clients, per transport.")
    b.panel("Transfer throughput", [
        (f"sum by (direction, transport, op) (rate(kvpool_node_transfer_bytes_total{{{N}}}[{R}]))", "{{direction}} {{transport}} {{op}}")],
        "Bps", "Bytes per second of those requests.")
    b.panel("Transfer latency", [
        (f"histogram_quantile(0.5, sum by (le, direction, transport) (rate(kvpool_node_transfer_seconds_bucket{{{N}}}[{R}])))", "p50 {{direction}} {{transport}}"),
        (f"histogram_quantile(0.99, sum by (le, direction, transport) (rate(kvpool_node_transfer_seconds_bucket{{{N}}}[{R}])))", "p99 {{direction}} {{transport}}")],
        "s", "Latency quantiles: of a request frame served, of a batch slice made.")
    b.panel("Transfer failures and failovers", [
        (f"sum by (instance, transport) (rate(kvpool_node_transfer_failures_total{{{N}}}[{R}]))", "failed on {{transport}} {{instance}}"),
        (f"sum by (instance, transport) (rate(kvpool_node_transfer_failovers_total{{{N}}}[{R}]))", "failed over from {{transport}} {{instance}}")],
        "ops", "Requests whose attempt on a transport failed, and requests moved to the next transport (KvpoolTransferFailovers). Empty while none happened.")
    b.panel("Node segments held / free", [
        (f"sum by (instance, segment, kind) (kvpool_node_segment_used_bytes{{{N}}})", "held {{segment}} ({{kind}})"),
        (f"sum by (instance, segment, kind) (kvpool_node_segment_free_bytes{{{N}}})", "free {{segment}} ({{kind}})")],
        "bytes", "Bytes held and free per segment, as each node reports the master's accounting.")
    b.panel("Node guard and master link", [
        (f"min by (instance) (kvpool_node_guard_alive{{{N}}})", "guard alive {{instance}}"),
        (f"min by (instance) (kvpool_node_master_reachable{{{N}}})", "master reachable {{instance}}")],
        "short", "1 while the segment guard process runs (KvpoolNodeGuardDown) and while the master answers the node (KvpoolNodeMasterUnreachable).")
    b.panel("Node SSD tier I/O", [
        (f"sum by (instance, op) (rate(kvpool_node_ssd_bytes_total{{{N}}}[{R}]))", "{{op}} {{instance}}")],
        "Bps", "Bytes read and written in the nodes' SSD-tier segment files.")
    b.panel("Node daemon transfer requests", [
        (f"sum by (instance) (rate(kvpool_transfer_requests_served_total{{{N}}}[{R}]))", "served {{instance}}"),
        (f"sum by (instance) (rate(kvpool_transfer_requests_refused_total{{{N}}}[{R}]))", "refused {{instance}}")],
        "reqps", "Requests (ranges) the node's transfer server served and refused per second. Same-host peers copy through shared memory and do not show here.")
    b.panel("Capability checks", [
        (f"sum by (instance) (rate(kvpool_capability_accepted_total{{{N}}}[{R}]))", "accepted {{instance}}"),
        (f"sum by (reason) (rate(kvpool_capability_refusals_total{{{N}}}[{R}]))", "refused: {{reason}}")],
        "reqps", "Transfer requests whose capability verified, and refusals by reason (KvpoolCapabilityRefusals, KvpoolCapabilityForged).")
    b.panel("Capability refusals (total)", [
        (f"sum by (reason) (increase(kvpool_capability_refusals_total{{{N}}}[1h]))", "{{reason}}")],
        "short", "Refusals in the last hour by reason.", kind="stat")

    b.row("HA")
    b.panel("Role", [
        (f'max by (instance) (kvpool_master_ha_role{{{M}, role="leader"}})', "{{instance}} leader")],
        "short", "1 while the instance leads its HA group (KvpoolNoLeader, KvpoolMultipleLeaders).")
    b.panel("Epoch and journal position", [
        (f"max(kvpool_master_ha_epoch{{{M}}})", "epoch"),
        (f"max by (instance) (kvpool_master_ha_lsn{{{M}}})", "lsn {{instance}}"),
        (f"max by (instance) (kvpool_master_ha_applied_lsn{{{M}}})", "applied {{instance}}")],
        "short", "The term (epoch; it grows at each failover) and each instance's last journal position.")
    b.panel("Standby lag", [
        (f"max by (standby) (kvpool_master_ha_standby_lag{{{M}}})", "{{standby}}")],
        "short", "Journal records each standby has not acknowledged, as the leader sees it (KvpoolStandbyLag).")
    b.panel("In-sync standbys", [
        (f"max(kvpool_master_ha_in_sync_standbys{{{M}}})", "in sync"),
        (f"min by (standby) (kvpool_master_ha_standby_in_sync{{{M}}})", "{{standby}} in sync")],
        "short", "Standbys in the leader's in-sync set (electable).")
    b.panel("Writes refused / fenced", [
        (f"max by (instance) (kvpool_master_ha_writes_refused{{{M}}})", "writes refused {{instance}}"),
        (f"max by (instance) (kvpool_master_ha_fenced{{{M}}})", "fenced {{instance}}")],
        "short", "1 while the leader refuses writes (KvpoolWritesRefused).")
    b.panel("Promotions and demotions", [
        (f"sum by (instance) (increase(kvpool_master_ha_promotions_total{{{M}}}[1h]))", "promotions {{instance}}"),
        (f"sum by (instance) (increase(kvpool_master_ha_demotions_total{{{M}}}[1h]))", "demotions {{instance}}")],
        "short", "Failovers in the last hour.")

    b.row("Clients and liveness")
    b.panel("Targets up", [
        (f'up{{{M}}}', "master {{instance}}"),
        (f'up{{{N}}}', "node {{instance}}")],
        "short", "1 while Prometheus scrapes the target (KvpoolMasterDown, KvpoolNodeDown).")
    b.panel("Clients", [
        (f"max(kvpool_master_clients{{{M}}})", "live"),
        (f"max(kvpool_master_suspect_clients{{{M}}})", "suspect"),
        (f"max(kvpool_master_suspect_segments{{{M}}})", "suspect segments")],
        "short", "Live clients (node daemons and pure clients), clients silent past client_ttl_s (KvpoolSuspectClients) and their segments.")
    b.panel("Client liveness events", [
        (f"sum(increase(kvpool_master_suspected_clients_total{{{M}}}[1h]))", "became suspect"),
        (f"sum(increase(kvpool_master_revived_clients_total{{{M}}}[1h]))", "revived"),
        (f"sum(increase(kvpool_master_expired_clients_total{{{M}}}[1h]))", "expired (dropped)"),
        (f"sum(increase(kvpool_master_lease_refusals_total{{{M}}}[1h]))", "removes refused (leased)")],
        "short", "In the last hour. Expired clients lost their segments and objects (KvpoolClientsExpired).")

    b.row("vLLM connector")
    b.panel("Token hit rate", [
        (f"sum(rate(kvpool_connector_hit_tokens_total{{{V}}}[{R}])) / sum(rate(kvpool_connector_lookup_tokens_total{{{V}}}[{R}]))", "hit tokens / looked up")],
        "percentunit", "Prompt tokens found in kvpool / prompt tokens looked up (vLLM's /metrics).",
        extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1}, "overrides": []}})
    b.panel("Loaded / saved bytes", [
        (f"sum by (instance) (rate(kvpool_connector_loaded_bytes_total{{{V}}}[{R}]))", "loaded {{instance}}"),
        (f"sum by (instance) (rate(kvpool_connector_saved_bytes_total{{{V}}}[{R}]))", "saved {{instance}}")],
        "Bps", "KV bytes the connector loaded from and saved to the pool.")
    b.panel("Load / save latency", [
        (f"histogram_quantile(0.5, sum by (le) (rate(kvpool_connector_load_seconds_bucket{{{V}}}[{R}])))", "load p50"),
        (f"histogram_quantile(0.99, sum by (le) (rate(kvpool_connector_load_seconds_bucket{{{V}}}[{R}])))", "load p99"),
        (f"histogram_quantile(0.5, sum by (le) (rate(kvpool_connector_save_seconds_bucket{{{V}}}[{R}])))", "save p50"),
        (f"histogram_quantile(0.99, sum by (le) (rate(kvpool_connector_save_seconds_bucket{{{V}}}[{R}])))", "save p99")],
        "s", "Quantiles of the connector's per-batch load and save latency histograms.")
    b.panel("Load / save errors", [
        (f"sum by (instance) (rate(kvpool_connector_load_errors_total{{{V}}}[{R}]))", "load errors {{instance}}"),
        (f"sum by (instance) (rate(kvpool_connector_save_errors_total{{{V}}}[{R}]))", "save errors {{instance}}")],
        "ops", "Chunks whose load failed after every replica and transport (vLLM recomputes them), and failed saves (KvpoolConnectorLoadErrors).")

    b.row("Tenants", collapsed=True)
    tenant_row = b.panels[-1]
    first = len(b.panels)
    T = f'{M}, tenant=~"$tenant"'
    b.panel("Tenant bytes by tier", [
        (f"max by (tenant, kind) (kvpool_master_tenant_used_bytes{{{T}}})", "{{tenant}} {{kind}}")],
        "bytes", "Bytes of object data per tenant and tier (size x replicas). Tenants whose bytes are not counted are left out.")
    b.panel("Tenant usage of quota", [
        (f'max by (tenant, kind) (kvpool_master_tenant_used_bytes{{{T}}}) / max by (tenant, kind) (kvpool_master_tenant_quota_bytes{{{T}, kind=~"memory|disk"}} > 0)', "{{tenant}} {{kind}}")],
        "percentunit", "Used / quota per tenant and tier (tenants with a quota). At 1 the tenant's puts get QUOTA_EXCEEDED.")
    b.panel("Tenant objects", [
        (f"max by (tenant) (kvpool_master_tenant_objects{{{T}}})", "{{tenant}}")],
        "short", "Complete objects per tenant.")
    b.panel("Tenant hit rate", [
        (f"sum by (tenant) (rate(kvpool_master_tenant_hits_total{{{T}}}[{R}])) / (sum by (tenant) (rate(kvpool_master_tenant_hits_total{{{T}}}[{R}])) + sum by (tenant) (rate(kvpool_master_tenant_misses_total{{{T}}}[{R}])))", "{{tenant}}")],
        "percentunit", "Replica lists and exists that found the object, per tenant.")
    b.panel("Tenant evictions and quota refusals", [
        (f"sum by (tenant) (rate(kvpool_master_tenant_evictions_total{{{T}}}[{R}]))", "evictions {{tenant}}"),
        (f"sum by (tenant) (rate(kvpool_master_tenant_refusals_total{{{T}}}[{R}]))", "quota refusals {{tenant}}")],
        "ops", "Objects evicted per tenant (pool pressure or its quota) and puts refused with QUOTA_EXCEEDED (KvpoolTenantQuotaRefusals).")
    tenant_row["panels"] = b.panels[first:]  # a collapsed row holds its panels
    del b.panels[first:]
    b.end_line()



def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schemaVersion 39)."""
    b = _Layout()
    _panels(b)
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus",
             "version": "1.0.0"}],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": "kvpool: pool capacity, objects, hit rate, traffic, evictions, "
                       "transfers, HA, liveness, tenants (deploy/prometheus has the scrape "
                       "config and alerts; docs/operations.md)",
        "editable": True, "graphTooltip": 1, "links": [], "liveNow": False,
        "panels": b.panels, "refresh": "30s", "schemaVersion": 39, "tags": ["kvpool"],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
             "options": []},
            _custom("master_job", "master job", "kvpool-master"),
            _custom("node_job", "node job", "kvpool-node"),
            _custom("vllm_job", "vLLM job", "vllm"),
            _label_values("tenant", "kvpool_master_tenant_objects", "tenant"),
            _label_values("segment", "kvpool_master_segment_capacity_bytes", "segment"),
        ]},
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "timezone": "",
        "title": "kvpool", "uid": "kvpool-overview", "version": 1, "weekStart": "",
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if --out differs from what this builds (writes nothing)")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python deploy/grafana/build_dashboard.py",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
