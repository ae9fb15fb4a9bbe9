"""``kvpool status``: segments (owner, host, kind, state, used/capacity), objects, uptime;
a tenant table (``kvpool tenant list``'s) when the master has named tenants.

A segment's state: ``active``; ``suspect`` (its owner missed its pings: no
new placements, objects kept until the owner is back, unmounts, or the
master's grace ends); ``awaiting`` (restored after a master restart, owner
not back yet).

With ``--master etcd://HOST:PORT[;...][/ID]`` (a master group, docs/ha.md)
it first lists every instance registered in etcd with its role, epoch,
replicated journal position and lag behind the leader (from each
instance's ``GET /health``), then the leader's segments.

``--json`` prints :func:`status_document`: a documented shape
(docs/status_json.md) with a ``schema`` version, :data:`STATUS_SCHEMA`, raised
with every change of a key or a value's type (tests/cluster/test_status_json.py
holds the shape and fails on a change the version does not announce).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.core.protocol import SegmentInfo, StatsReply

__all__ = ["STATUS_SCHEMA", "format_instances", "format_status", "group_instances", "register",
           "status_document"]

#: the version of ``kvpool status --json``'s shape (docs/status_json.md)
STATUS_SCHEMA = 4
#: the keys of one ``instances`` row (None where unknown)
_INSTANCE_KEYS = ("instance_id", "address", "role", "epoch", "lsn", "objects", "lag", "error")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="show the pool's segments and objects",
                              description="Ask a master for its segments and object count.")
    from kvpool.store.config import ClientConfig

    defaults = ClientConfig()
    p.add_argument("--master", default=defaults.master_address,
                   help="master address HOST:PORT, or a group etcd://HOST:PORT[;...][/ID] "
                        "(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=defaults.rpc_timeout_s,
                   help="RPC timeout in seconds (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print raw JSON instead of a table")
    p.set_defaults(func=_main)


def _fmt_uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def format_status(stats: StatsReply, segments: list[SegmentInfo]) -> str:
    """Render STATS + LIST_SEGMENTS as a text table."""
    from kvpool.core.config import format_size

    rows = [("SEGMENT", "OWNER", "HOST", "KIND", "STATE", "USED", "CAPACITY", "USE%")]
    for s in sorted(segments, key=lambda s: (s.descriptor.host_id, s.descriptor.segment_id)):
        d = s.descriptor
        cap, used = s.capacity, s.used
        rows.append((d.segment_id, d.client_id[:12], d.host_id, d.kind.name.lower(), s.state,
                     format_size(used), format_size(cap),
                     f"{100.0 * used / cap:.1f}" if cap else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    suspect = sum(1 for s in segments if s.state == "suspect")
    lines.append(
        f"segments: {len(segments)}"
        + (f" ({suspect} suspect)" if suspect else "")
        + f"   objects: {stats.objects}   "
        f"used: {format_size(stats.bytes_used)} / {format_size(stats.bytes_capacity)}   "
        f"uptime: {_fmt_uptime(stats.uptime_s)}"
    )
    return "\n".join(lines)


def status_document(stats: StatsReply, segments: list[SegmentInfo],
                    instances: list[dict[str, Any]] | None = None,
                    tenants: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``kvpool status --json``: ``schema`` (:data:`STATUS_SCHEMA`), ``stats``
    (every counter, flat), ``segments`` (usage and state, the descriptor's map
    form under ``descriptor``, its ids also at the top) and, for a master
    group, ``instances`` (:func:`group_instances`) and, when the master has
    named tenants, ``tenants`` (:func:`kvpool.cluster.tenant_cli.tenant_dicts`).
    docs/status_json.md has every key."""
    rows = []
    for s in segments:
        d = s.descriptor
        rows.append({"segment_id": d.segment_id, "client_id": d.client_id,
                     "host_id": d.host_id, "state": s.state, "used": s.used,
                     "capacity": s.capacity, "fragmentation": s.fragmentation,
                     "free_blocks": s.free_blocks, "objects": s.objects,
                     "descriptor": d.to_wire()})
    doc: dict[str, Any] = {"schema": STATUS_SCHEMA, "stats": stats.as_dict(), "segments": rows}
    if instances is not None:
        doc["instances"] = instances
    if tenants:
        doc["tenants"] = tenants
    return doc


def group_instances(address: str, timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """Every instance of the master group ``address`` (``etcd://...``), leader
    first: its ``instance_id``, RPC ``address`` and ``/health`` (``role``,
    ``epoch``, ``lsn``, ``objects``; ``lag`` behind the leader's lsn;
    ``role: "unreachable"`` and ``error`` when its health does not answer).
    Every row has every key; None where unknown."""
    import urllib.request

    from kvpool.core.etcd import LeaderResolver

    with LeaderResolver(address, timeout_s, watch=False) as r:
        members = r.members()
    out: list[dict[str, Any]] = []
    for m, _is_leader in members:
        row: dict[str, Any] = dict.fromkeys(_INSTANCE_KEYS)
        row.update(instance_id=m.instance_id, address=m.address)
        try:
            with urllib.request.urlopen(f"http://{m.metrics}/health", timeout=timeout_s) as f:
                h = json.load(f)
            row.update(role=h.get("role"), epoch=h.get("epoch"), lsn=h.get("lsn"),
                       objects=h.get("objects"))
        except (OSError, ValueError) as exc:
            row.update(role="unreachable", error=str(exc))
        out.append(row)
    leader_lsn = max((r["lsn"] for r in out if r.get("role") == "leader"
                      and isinstance(r.get("lsn"), int)), default=None)
    for row in out:
        if leader_lsn is not None and isinstance(row.get("lsn"), int):
            row["lag"] = max(0, leader_lsn - row["lsn"])
    return sorted(out, key=lambda r: (r.get("role") != "leader", r["instance_id"]))


def format_instances(rows: list[dict[str, Any]]) -> str:
    """Render :func:`group_instances`' rows as a text table ("-": unknown)."""

    def cell(r: dict[str, Any], key: str) -> str:
        v = r.get(key)
        return "-" if v is None else str(v)

    table = [("INSTANCE", "ROLE", "EPOCH", "LSN", "LAG", "OBJECTS")]
    for r in rows:
        table.append((r["instance_id"], cell(r, "role"), cell(r, "epoch"), cell(r, "lsn"),
                      cell(r, "lag"), cell(r, "objects")))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip()
                     for t in table)


def _main(args: argparse.Namespace) -> int:
    from kvpool.cluster.tenant_cli import format_tenants, tenant_dicts
    from kvpool.core.errors import KVPoolError
    from kvpool.core.etcd import is_etcd_url
    from kvpool.core.protocol import ListSegments, Stats, TenantList
    from kvpool.core.rpc_client import MasterClient, MasterRPCError
    from kvpool.core.tenants import DEFAULT_TENANT

    instances: list[dict[str, Any]] | None = None
    if is_etcd_url(args.master):
        try:
            instances = group_instances(args.master, min(args.timeout, 2.0))
        except KVPoolError as exc:
            print(f"kvpool status: master group {args.master}: {exc}")
            return 1
        if not args.json:
            print(format_instances(instances))
            print("")
    with MasterClient(args.master, timeout_s=args.timeout) as mc:
        try:
            stats = mc.call(Stats())
            segments = mc.call(ListSegments()).segments
        except MasterRPCError as exc:
            print(f"kvpool status: master {args.master}: {exc}")
            return 1
        try:
            tenants = mc.call(TenantList()).tenants
        except MasterRPCError:  # a master from before tenants
            tenants = []
    if not any(t.name != DEFAULT_TENANT for t in tenants):
        tenants = []  # only the default tenant: nothing to show
    if args.json:
        print(json.dumps(status_document(stats, segments, instances, tenant_dicts(tenants)),
                         indent=2, default=str))
    else:
        print(format_status(stats, segments))
        if tenants:
            print("")
            print(format_tenants(tenants))
    return 0
