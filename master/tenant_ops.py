"""The handlers of tenant quotas: TENANT_SET and TENANT_LIST (docs/tenants.md)."""

from __future__ import annotations

from typing import Any

from kvpool.core.protocol import TenantList, TenantListReply, TenantRow, TenantSet
from kvpool.core.tenants import tenant_name
from kvpool.master.op_group import OpGroup, bad

__all__ = ["TenantOps", "tenant_rows"]


def tenant_rows(rows: list[dict[str, Any]]) -> list[TenantRow]:
    """:meth:`TenantTable.rows` as wire rows (bytes not counted: -1)."""
    return [TenantRow(r["name"], r["memory_quota"], r["disk_quota"], r["guaranteed"],
                      -1 if r["memory_used"] is None else r["memory_used"],
                      -1 if r["disk_used"] is None else r["disk_used"], r["objects"],
                      r["hits"], r["misses"], r["evictions"], r["refusals"]) for r in rows]


class TenantOps(OpGroup):
    """Tenant quotas, set live and listed."""

    def tenant_set(self, req: TenantSet) -> TenantListReply:
        """Set tenant ``req.name``'s quotas (journaled: a ``SetQuota`` record);
        reply with its row. A quota lowered below the usage evicts nothing at
        once: the tenant's next puts make room within it (its own LRU)."""
        name = tenant_name(req.name)
        for what, v in (("memory", req.memory), ("disk", req.disk),
                        ("guaranteed", req.guaranteed)):
            if v < -1:
                raise bad(f"{what} must be >= 0 or -1 (unlimited), got {v}")
        self.dir.set_tenant_quota(name, req.memory, req.disk, req.guaranteed)
        self.count_one("tenant_set")
        rows = [r for r in self.dir.tenants.rows(len(self.dir.objects)) if r["name"] == name]
        return TenantListReply(tenant_rows(rows))

    def tenant_list(self, req: TenantList) -> TenantListReply:
        """Every tenant the master knows, ``default`` first."""
        return TenantListReply(tenant_rows(self.dir.tenants.rows(len(self.dir.objects))))
