"""The connector's ``"tenant"`` (kv_connector_extra_config) against a real pool:
its store client acts for that tenant, so lookups see that tenant's chunks only."""

from __future__ import annotations

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.store_access import StoreAccess
from kvpool.store import Client, ClientConfig


def test_connector_tenant_scopes_lookups() -> None:
    ks = KeySpace("m", "bf16", 16, 32)
    toks = list(range(65))
    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="8MiB"):
        with Client(ClientConfig(master_address=m.address, tenant="team-a")) as writer:
            for h in ks.chunk_hashes(toks):
                for k in ks.chunk_keys(h, 1, 4):
                    writer.put(k, b"kv")
            found = {}
            for t in ("team-a", "team-b", None):
                extra = {"master_address": m.address, "chunk_size": 32}
                if t is not None:
                    extra["tenant"] = t
                cfg = ConnectorConfig.from_extra_config(extra)
                store = StoreAccess(cfg)
                try:
                    found[t] = KVPoolScheduler(cfg, ks, 1, store).lookup("r", toks, 0)
                    assert store.client().tenant == (t or "default")
                finally:
                    store.close()
    # the same model and prompt: a hit for the tenant that stored it only
    assert found == {"team-a": (64, False), "team-b": (0, False), None: (0, False)}
