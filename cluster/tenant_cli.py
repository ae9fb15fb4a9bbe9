"""``kvpool tenant``: set a tenant's quotas live and list the tenants
(docs/tenants.md).

``kvpool tenant set NAME --memory SIZE [--disk SIZE] [--guaranteed SIZE]
--master ADDR`` sends TENANT_SET (a limit left out or ``-1`` /
``unlimited`` = unlimited) and prints the tenant's row; ``kvpool tenant
list --master ADDR [--json]`` prints every tenant's quotas, usage and
counters (TENANT_LIST).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.core.protocol import TenantRow

__all__ = ["format_tenants", "register", "tenant_dicts"]

_COLUMNS = ("name", "memory_used", "memory_quota", "disk_used", "disk_quota", "guaranteed",
            "objects", "hits", "misses", "evictions", "refusals")


def _size(text: str) -> int:
    """A limit on the command line: a size (``32MiB``), or -1 / ``unlimited``."""
    from kvpool.core.config import ConfigError, parse_size

    if text.strip().lower() in ("-1", "unlimited", "none"):
        return -1
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: Any) -> None:
    from kvpool.store.config import ClientConfig

    defaults = ClientConfig()
    p = subparsers.add_parser("tenant", help="set and list tenant quotas",
                              description="Tenant quotas at a master (docs/tenants.md).")
    sub = p.add_subparsers(dest="tenant_command", metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--master", default=defaults.master_address,
                       help="master address HOST:PORT or etcd://... (default: %(default)s)")
        q.add_argument("--timeout", type=float, default=defaults.rpc_timeout_s,
                       help="RPC timeout in seconds (default: %(default)s)")
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")

    s = sub.add_parser("set", help="set a tenant's quotas live (journaled, replicated)")
    s.add_argument("name", help="tenant name")
    s.add_argument("--memory", type=_size, default=-1,
                   help="memory quota, e.g. 32MiB (default: unlimited)")
    s.add_argument("--disk", type=_size, default=-1, help="disk quota (default: unlimited)")
    s.add_argument("--guaranteed", type=_size, default=-1,
                   help="memory share kept under pool pressure (default: none)")
    common(s)
    s.set_defaults(func=_set)
    ls = sub.add_parser("list", help="every tenant's quotas, usage and counters")
    common(ls)
    ls.set_defaults(func=_list)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def tenant_dicts(rows: list[TenantRow]) -> list[dict[str, Any]]:
    """Wire rows as JSON objects (-1: unlimited / not counted)."""
    return [{c: getattr(r, c) for c in _COLUMNS} for r in rows]


def format_tenants(rows: list[TenantRow]) -> str:
    """A text table of tenant rows ("-": unlimited or not counted)."""
    from kvpool.core.config import format_size

    def size(v: int) -> str:
        return "-" if v < 0 else format_size(v)

    table = [("TENANT", "MEMORY", "MEM QUOTA", "DISK", "DISK QUOTA", "GUARANTEED", "OBJECTS",
              "HITS", "MISSES", "EVICTIONS", "REFUSALS")]
    for r in rows:
        table.append((r.name, size(r.memory_used), size(r.memory_quota), size(r.disk_used),
                      size(r.disk_quota), size(r.guaranteed), str(r.objects), str(r.hits),
                      str(r.misses), str(r.evictions), str(r.refusals)))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip()
                     for t in table)


def _call(args: argparse.Namespace, req: Any) -> list[TenantRow] | None:
    from kvpool.core.errors import KVPoolError
    from kvpool.core.rpc_client import MasterClient

    try:
        with MasterClient(args.master, timeout_s=args.timeout) as mc:
            rows: list[TenantRow] = mc.call(req).tenants
            return rows
    except KVPoolError as exc:
        print(f"kvpool tenant: master {args.master}: {exc}")
        return None


def _show(args: argparse.Namespace, rows: list[TenantRow] | None) -> int:
    if rows is None:
        return 1
    if args.json:
        print(json.dumps(tenant_dicts(rows), indent=2))
    else:
        print(format_tenants(rows))
    return 0


def _set(args: argparse.Namespace) -> int:
    from kvpool.core.protocol import TenantSet

    return _show(args, _call(args, TenantSet(args.name, args.memory, args.disk,
                                             args.guaranteed)))


def _list(args: argparse.Namespace) -> int:
    from kvpool.core.protocol import TenantList

    return _show(args, _call(args, TenantList()))
