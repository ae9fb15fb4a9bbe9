"""Configuration of the vLLM connector, read from ``kv_connector_extra_config``.

Example (``--kv-transfer-config``)::

    {"kv_connector": "KVPoolConnector",
     "kv_connector_module_path": "kvpool.connector.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"master_address": "127.0.0.1:50051",
                                   "chunk_size": 256, "save_decode": false,
                                   "load_async": false, "tenant": "team-a"}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvpool.core.config import ConfigError, check_settings, load_dataclass, setting
from kvpool.core.errors import KVPoolError
from kvpool.core.tenants import tenant_name

__all__ = ["ConnectorConfig", "LoadFailurePolicy", "PoolClientSettings"]


class LoadFailurePolicy(StrEnum):
    """What a failed or late load does to the request (``load_failure_policy``).

    ``RECOMPUTE``: the connector sets vLLM's ``kv_load_failure_policy`` to
    "recompute" (vLLM's default is "fail": a block reported as not loaded ends
    the request with ``finish_reason=error``); kvpool is a cache, so a block it
    could not deliver is computed instead. ``VLLM``: keep whatever
    ``kv_load_failure_policy`` vLLM was given.
    """

    RECOMPUTE = "recompute"
    VLLM = "vllm"


@dataclass
class PoolClientSettings:
    """How an engine-side integration reaches the pool: the settings of its
    store client, shared by the connector (:class:`ConnectorConfig`) and the
    offloading tier (``OffloadTierConfig``); the client is built from them by
    :func:`kvpool.connector.store_access.client_config`."""

    master_address: str | None = setting(
        None, help="kvpool master `HOST:PORT`; overrides the client YAML's")
    local_address: str | None = setting(
        None, help="this host's address for the client's transfer server (bind and "
        "advertise; the node's IP in a multi-host pool); null: the client YAML's (127.0.0.1)")
    host_id: str | None = setting(
        None, help="this host's id (processes with one id share memory through shm); "
        "null: the hostname")
    client_config: str | None = setting(
        None, help="path of a kvpool client YAML (`configs/client.yaml` keys); null: "
        "`$KVPOOL_CONFIG` if set")
    tenant: str | None = setting(
        None, help="the tenant this engine's client acts for (docs/tenants.md): its chunks, "
        "lookups and quota are that tenant's, and engines of another tenant neither see nor "
        "evict them; null: the client YAML's (else `default`)")
    client_overrides: dict[str, Any] = setting(
        default_factory=dict, help="extra client keys, e.g. `{\"memory_size\": \"8GiB\"}` to "
        "also contribute memory from the engine's process")


@dataclass
class ConnectorConfig(PoolClientSettings):
    """Connector settings (``kv_connector_extra_config``): the pool client's
    (:class:`PoolClientSettings`) and the connector's own. Unknown keys raise
    :class:`ConfigError`; docs/vllm.md's key table is rendered from the fields."""

    chunk_size: int = setting(
        256, gt=0, help="tokens per stored chunk; a multiple of vLLM's `--block-size` (CPU: block "
        "size multiple of 32)")
    save_decode: bool = setting(
        False, help="also store chunks completed by generated tokens (multi-turn chat)")
    load_async: bool = setting(
        False, help="load between scheduler steps (the request waits in "
        "`WAITING_FOR_REMOTE_KVS`, other requests keep running) instead of synchronously "
        "before the forward")
    model_id: str | None = setting(
        None, help="key namespace; null: vLLM's model name (set it when the same weights are "
        "served under different paths)")
    rpc_timeout_s: float = setting(
        2.0, gt=0,
        help="master RPC timeout of the connector's client (short, so a dead master costs "
        "little)")
    retry_interval_s: float = setting(
        5.0, ge=0, help="after a store failure the connector skips kvpool this long")
    replica_num: int = setting(1, ge=1, help="memory replicas per stored object")
    staging_mib: float = setting(
        512, gt=0, help="size of each of the worker's two staging buffers (save, load) on the KV "
        "cache's device, MiB; a chunk's blocks are gathered there and moved as one object. "
        "Steps larger than it move in batches of whole chunks (and load before the forward "
        "instead of layer-wise)")
    lookup_all_layers: bool = setting(
        True, help="accepted for compatibility; no effect (a lookup checks every object of a "
        "chunk)")
    load_failure_policy: str = setting(
        LoadFailurePolicy.RECOMPUTE.value,
        help="`recompute`: the connector sets vLLM's `kv_load_failure_policy` to "
        "\"recompute\", so blocks kvpool could not deliver are computed; `vllm`: keep vLLM's "
        "own setting (its default, \"fail\", ends such a request with "
        "`finish_reason=error`)")
    load_timeout_s: float = setting(
        2.0, gt=0, le=60,
        help="a request's load still running after this long is abandoned and its "
        "missing blocks recomputed (below the master's 10 s read lease, so no read outlives "
        "its lease)")
    load_or_recompute: bool = setting(
        True, help="decide per request from measured speeds whether to load a hit or compute "
        "it (kvpool.connector.estimate); false loads every hit, bounded by `load_timeout_s`")
    probe_fraction: float = setting(
        0.25, gt=0, le=1, help="a load from a peer not measured yet may take this fraction of the "
        "request's recompute time")
    reprobe_s: float = setting(
        30.0, gt=0, help="how long a peer's measured speed (or failure) stands before it is probed "
        "again")
    layer_groups: int = setting(
        8, ge=1, le=1024,
        help="objects per chunk along the layers; loads are pipelined per group (group "
        "g + 1 moves while group g computes). Part of the keys: engines sharing chunks use the "
        "same value")
    layerwise: bool = setting(
        True, help="load layer group by layer group during the forward "
        "(`wait_for_layer_load`) and save each group as its layers finish "
        "(`save_kv_layer`); false: whole requests before / after the forward")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config`` dict (None = defaults)
        with the loader every kvpool config uses (:func:`load_dataclass`): unknown
        keys, wrong types and bad values raise :class:`ConfigError` naming the key."""
        return load_dataclass(cls, extra or {}, prefix="kv_connector_extra_config.")

    def validate(self, block_size: int | None = None) -> None:
        """Raise :class:`ConfigError` on values that cannot work: a field of a
        wrong type or out of its bounds (:func:`check_settings`), a policy that
        is none, a chunk that is not whole blocks of ``block_size``, a bad
        tenant name."""
        check_settings(self)
        if self.tenant is not None:
            try:
                tenant_name(self.tenant)
            except KVPoolError as exc:
                raise ConfigError(f"kv_connector_extra_config.tenant: {exc.args[0]}") from None
        if block_size is not None and self.chunk_size % block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} must be a multiple of the block size {block_size}"
            )
        if self.load_failure_policy not in {p.value for p in LoadFailurePolicy}:
            raise ConfigError(f"load_failure_policy must be one of "
                              f"{[p.value for p in LoadFailurePolicy]}, "
                              f"got {self.load_failure_policy!r}")
