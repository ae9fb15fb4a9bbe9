"""``kvpool status``: segments (owner, host, kind, state, used/capacity), objects, uptime.

A segment's state: ``active``; ``suspect`` (its owner missed its pings: no
new placements, objects kept until the owner is back, unmounts, or the
master's grace ends); ``awaiting`` (restored after a master restart, owner
not back yet).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["format_status", "register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="show the pool's segments and objects",
                              description="Ask a master for its segments and object count.")
    p.add_argument("--master", default="127.0.0.1:50051", help="master address HOST:PORT")
    p.add_argument("--timeout", type=float, default=5.0, help="RPC timeout in seconds")
    p.add_argument("--json", action="store_true", help="print raw JSON instead of a table")
    p.set_defaults(func=_main)


def _fmt_uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def format_status(stats: dict[str, Any], segments: list[dict[str, Any]]) -> str:
    """Render STATS + LIST_SEGMENTS as a text table."""
    from kvpool.core.config import format_size
    from kvpool.core.protocol import SegmentKind

    rows = [("SEGMENT", "OWNER", "HOST", "KIND", "STATE", "USED", "CAPACITY", "USE%")]
    for s in sorted(segments, key=lambda s: (str(s.get("host_id")), str(s.get("segment_id")))):
        cap = int(s.get("capacity", s.get("size", 0)) or 0)
        used = int(s.get("used", 0) or 0)
        try:
            kind = SegmentKind(int(s.get("kind", 0))).name.lower()
        except ValueError:
            kind = str(s.get("kind"))
        rows.append((str(s.get("segment_id", "?")), str(s.get("client_id", "?"))[:12],
                     str(s.get("host_id", "?")), kind, str(s.get("state", "?")),
                     format_size(used), format_size(cap),
                     f"{100.0 * used / cap:.1f}" if cap else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    used_total = int(stats.get("bytes_used", sum(int(s.get("used", 0) or 0) for s in segments)))
    cap_total = int(stats.get("bytes_capacity", 0) or 0)
    lines.append("")
    suspect = sum(1 for s in segments if s.get("state") == "suspect")
    lines.append(
        f"segments: {len(segments)}"
        + (f" ({suspect} suspect)" if suspect else "")
        + f"   objects: {stats.get('objects', '?')}   "
        f"used: {format_size(used_total)} / {format_size(cap_total)}   "
        f"uptime: {_fmt_uptime(float(stats.get('uptime_s', 0)))}"
    )
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    from kvpool.core.protocol import Op
    from kvpool.core.rpc_client import MasterClient, MasterRPCError

    with MasterClient(args.master, timeout_s=args.timeout) as mc:
        try:
            stats = mc.call(Op.STATS)
            segments = list(mc.call(Op.LIST_SEGMENTS).get("segments", []))
        except MasterRPCError as exc:
            print(f"kvpool status: master {args.master}: {exc}")
            return 1
    if args.json:
        print(json.dumps({"stats": stats, "segments": segments}, indent=2, default=str))
    else:
        print(format_status(stats, segments))
    return 0
