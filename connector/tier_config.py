"""Configuration of kvpool as a secondary tier of vLLM's native offloading.

The tier is one entry of ``secondary_tiers`` in the ``kv_connector_extra_config``
of vLLM's ``OffloadingConnector``; every key of that entry other than ``type``,
``module_path`` and ``backpressure`` (which vLLM's tier factory consumes) is a
field of :class:`OffloadTierConfig`::

    {"type": "KVPoolTier", "module_path": "kvpool.connector.offload_tier",
     "master_address": "10.0.0.1:50051", "locality": "REMOTE"}

Kept apart from the tier class so that reading or documenting the settings
does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.connector.config import ConnectorConfig, PoolClientSettings
from kvpool.core.config import ConfigError, check_settings, load_dataclass, setting

__all__ = ["LOCALITIES", "OffloadTierConfig"]

#: The values of vLLM's ``Locality`` enum (``locality``).
LOCALITIES = ("LOCAL", "REMOTE")


@dataclass
class OffloadTierConfig(PoolClientSettings):
    """Settings of the kvpool secondary tier (keys of its ``secondary_tiers``
    entry): the pool client's (:class:`PoolClientSettings`) and the tier's own.
    Unknown keys raise :class:`ConfigError`; docs/vllm.md's table of them is
    rendered from these fields."""

    rpc_timeout_s: float = setting(
        2.0, gt=0, help="master RPC timeout of the tier's client (short: a dead master costs "
        "little)")
    retry_interval_s: float = setting(
        5.0, ge=0, help="after a pool failure the tier answers misses and drops stores this long "
        "before trying the pool again")
    replica_num: int = setting(1, ge=1, help="memory replicas per stored chunk")
    prefix: str = setting(
        "kvpool-tier", help="first part of every key; engines that share chunks use the same "
        "value (the rest is vLLM's file name of the chunk: model, layout digest, chunk hash)")
    locality: str = setting(
        "REMOTE", help="vLLM locality of the tier (`LOCAL` or `REMOTE`), seen by request tier "
        "filters and KV events (vLLM's backpressure presets read the entry's own key: set it "
        "there for them)")
    load_threads: int = setting(
        2, ge=1, le=64, help="threads moving chunks from the pool into the CPU tier")
    store_threads: int = setting(
        2, ge=1, le=64, help="threads moving chunks from the CPU tier into the pool")
    max_inflight_stores: int = setting(
        16, ge=1, help="store jobs queued or moving at once; a store submitted beyond it is "
        "dropped at once (reported failed: the chunk stays in the CPU tier only)")
    max_inflight_mib: float = setting(
        256.0, gt=0, help="bytes of store jobs queued or moving at once, MiB; beyond it stores "
        "are dropped as above")
    lookup_wait_s: float = setting(
        2.0, gt=0, help="a chunk whose lookup has no answer this long after it was first asked "
        "(slow master, or another engine's store of it still in flight) is a miss; a miss this "
        "old is asked again for a request that had not asked it yet")
    enable_kv_events: bool = setting(
        False, help="emit vLLM's offloading events (BlockStored, medium CPU, the tier's "
        "locality) for chunks stored into the pool; effective only with KV cache events on")

    @classmethod
    def from_tier_config(cls, entry: Mapping[str, Any] | None) -> OffloadTierConfig:
        """Build from the tier's ``secondary_tiers`` entry as vLLM's factory
        passes it (``type``/``module_path``/``backpressure`` already removed):
        unknown keys, wrong types and bad values raise :class:`ConfigError`."""
        return load_dataclass(cls, entry or {}, prefix="secondary_tiers[kvpool].")

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a value that cannot work (bounds, locality,
        a bad tenant name, an empty prefix)."""
        check_settings(self)
        if self.locality not in LOCALITIES:
            raise ConfigError(f"secondary_tiers[kvpool].locality must be one of {LOCALITIES}, "
                              f"got {self.locality!r}")
        if not self.prefix or self.prefix < " ":
            raise ConfigError("secondary_tiers[kvpool].prefix must be a non-empty key start "
                              "(no control characters)")
        self.connector_config().validate()

    def connector_config(self) -> ConnectorConfig:
        """The client settings as the connector's :class:`ConnectorConfig`, so the
        tier reaches the pool through the connector's own store access
        (:class:`~kvpool.connector.store_access.StoreAccess`)."""
        return ConnectorConfig(
            master_address=self.master_address, local_address=self.local_address,
            host_id=self.host_id, client_config=self.client_config, tenant=self.tenant,
            client_overrides=dict(self.client_overrides), rpc_timeout_s=self.rpc_timeout_s,
            retry_interval_s=self.retry_interval_s, replica_num=self.replica_num)
