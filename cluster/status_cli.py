"""``kvpool status``: segments (owner, host, kind, state, used/capacity), objects, uptime.

A segment's state: ``active``; ``suspect`` (its owner missed its pings: no
new placements, objects kept until the owner is back, unmounts, or the
master's grace ends); ``awaiting`` (restored after a master restart, owner
not back yet).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.core.protocol import SegmentInfo, StatsReply

__all__ = ["format_status", "register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="show the pool's segments and objects",
                              description="Ask a master for its segments and object count.")
    from kvpool.store.config import ClientConfig

    defaults = ClientConfig()
    p.add_argument("--master", default=defaults.master_address,
                   help="master address HOST:PORT (default: %(default)s)")
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


def _main(args: argparse.Namespace) -> int:
    import msgspec

    from kvpool.core.protocol import ListSegments, Stats
    from kvpool.core.rpc_client import MasterClient, MasterRPCError

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
        print(json.dumps({"stats": stats.as_dict(), "segments": rows}, indent=2, default=str))
    else:
        print(format_status(stats, segments))
    return 0
