"""``kvpool status``: segments (owner, host, kind, state, used/capacity), objects, uptime.

A segment's state: ``active``; ``suspect`` (its owner missed its pings: no
new placements, objects kept until the owner is back, unmounts, or the
master's grace ends); ``awaiting`` (restored after a master restart, owner
not back yet).

With ``--master etcd://HOST:PORT[;...][/ID]`` (a master group, docs/ha.md)
it first lists every instance registered in etcd with its role, epoch,
replicated journal position and lag behind the leader (from each
instance's ``GET /health``), then the leader's segments.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.core.protocol import SegmentInfo, StatsReply

__all__ = ["format_instances", "format_status", "group_instances", "register"]


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


def group_instances(address: str, timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """Every instance of the master group ``address`` (``etcd://...``): its
    id, RPC address and ``/health`` (role, epoch, lsn; ``lag`` behind the
    leader's lsn; ``role: "unreachable"`` when its health does not answer)."""
    import urllib.request

    from kvpool.core.etcd import LeaderResolver

    with LeaderResolver(address, timeout_s, watch=False) as r:
        members = r.members()
    out: list[dict[str, Any]] = []
    for m, _is_leader in members:
        row: dict[str, Any] = {"instance_id": m.instance_id, "address": m.address}
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
    table = [("INSTANCE", "ROLE", "EPOCH", "LSN", "LAG", "OBJECTS")]
    for r in rows:
        table.append((r["instance_id"], str(r.get("role")), str(r.get("epoch", "-")),
                      str(r.get("lsn", "-")), str(r.get("lag", "-")),
                      str(r.get("objects", "-"))))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip()
                     for t in table)


def _main(args: argparse.Namespace) -> int:
    import msgspec

    from kvpool.core.errors import KVPoolError
    from kvpool.core.etcd import is_etcd_url
    from kvpool.core.protocol import ListSegments, Stats
    from kvpool.core.rpc_client import MasterClient, MasterRPCError

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
    if args.json:
        rows = [{**msgspec.structs.asdict(s), "descriptor": s.descriptor.to_wire()}
                for s in segments]
        doc: dict[str, Any] = {"stats": stats.as_dict(), "segments": rows}
        if instances is not None:
            doc["instances"] = instances
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(format_status(stats, segments))
    return 0
