"""Configuration of the vLLM connector, read from ``kv_connector_extra_config``.

Example (``--kv-transfer-config``)::

    {"kv_connector": "KVPoolConnector",
     "kv_connector_module_path": "kvpool.connector.vllm",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"master_address": "127.0.0.1:50051",
                                   "chunk_size": 256, "save_decode": false,
                                   "load_async": false}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvpool.core.config import ConfigError, load_dataclass

__all__ = ["ConnectorConfig", "LoadFailurePolicy"]


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
class ConnectorConfig:
    """Connector settings. Unknown keys raise :class:`ConfigError`.

    - ``master_address``: kvpool master ``HOST:PORT``; overrides the YAML's.
    - ``local_address``: this host's address for the connector's transfer
      server (bind and advertise; the node's IP in a multi-host pool).
    - ``host_id``: this host's id (processes with one id share memory by shm).
    - ``client_config``: path of a kvpool client YAML (``configs/client.yaml`` keys).
    - ``client_overrides``: extra ClientConfig keys (e.g. ``{"memory_size": "1GiB"}``).
    - ``chunk_size``: tokens per stored chunk; a multiple of vLLM's block size.
    - ``save_decode``: also store chunks filled by generated tokens.
    - ``load_async``: load between scheduler steps (request waits in
      WAITING_FOR_REMOTE_KVS) instead of synchronously before the forward.
    - ``model_id``: key namespace; defaults to vLLM's model name.
    - ``rpc_timeout_s``: master RPC timeout of the connector's client (short, so
      a dead master costs little).
    - ``retry_interval_s``: after a store failure, skip the store this long.
    - ``replica_num``: memory replicas per stored object.
    - ``staging_mib``: size of each of the worker's two staging buffers (save,
      load) on the KV cache's device; a chunk's blocks are gathered there
      and moved as one object. Requests larger than it move in groups of
      whole chunks (one store batch per group).
    - ``lookup_all_layers``: accepted for compatibility, no effect (a lookup
      checks every object of a chunk).
    - ``load_failure_policy``: "recompute" (default) makes vLLM recompute the
      blocks of a failed or late load; "vllm" keeps vLLM's own
      ``kv_load_failure_policy`` (see :class:`LoadFailurePolicy`).
    - ``load_timeout_s``: a request's load that has not finished after this
      long is abandoned; its missing blocks are recomputed. Kept below the
      master's read lease (10 s by default) so no read outlives its lease.
    - ``load_or_recompute``: decide per request from measured speeds whether
      loading a hit is faster than computing it (:mod:`kvpool.connector.estimate`);
      false loads every hit (bounded by ``load_timeout_s``).
    - ``probe_fraction``: a load from a peer not measured yet may take this
      fraction of the request's recompute time before it is abandoned.
    - ``reprobe_s``: how long a peer's measured speed (or its failure) stands
      before a new probe.
    - ``layer_groups``: stored objects per chunk along the layers (and loads
      pipelined per group: group ``g + 1`` moves while group ``g`` computes).
      Part of the keys: engines sharing chunks must use the same value.
    - ``layerwise``: load layer group by layer group during the forward
      (``wait_for_layer_load``) and save each group as its layers finish
      (``save_kv_layer``); false loads whole requests before the forward and
      saves after it.
    """

    master_address: str | None = None
    local_address: str | None = None
    host_id: str | None = None
    client_config: str | None = None
    client_overrides: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 256
    save_decode: bool = False
    load_async: bool = False
    model_id: str | None = None
    rpc_timeout_s: float = 2.0
    retry_interval_s: float = 5.0
    replica_num: int = 1
    staging_mib: float = 512
    lookup_all_layers: bool = True
    load_failure_policy: str = LoadFailurePolicy.RECOMPUTE.value
    load_timeout_s: float = 2.0
    load_or_recompute: bool = True
    probe_fraction: float = 0.25
    reprobe_s: float = 30.0
    layer_groups: int = 8
    layerwise: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config`` dict (None = defaults)
        with the loader every kvpool config uses (:func:`load_dataclass`): unknown
        keys, wrong types and bad values raise :class:`ConfigError` naming the key."""
        return load_dataclass(cls, extra or {}, prefix="kv_connector_extra_config.")

    def validate(self, block_size: int | None = None) -> None:
        """Raise :class:`ConfigError` on values that cannot work."""
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if block_size is not None and self.chunk_size % block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} must be a multiple of the block size {block_size}"
            )
        if not 0 < self.probe_fraction <= 1 or self.reprobe_s <= 0:
            raise ConfigError("probe_fraction must be in (0, 1] and reprobe_s > 0")
        if not isinstance(self.layer_groups, int) or not 1 <= self.layer_groups <= 1024:
            raise ConfigError(f"layer_groups must be an int in 1..1024, got {self.layer_groups!r}")
        for name in ("save_decode", "load_async", "lookup_all_layers", "load_or_recompute",
                     "layerwise"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool")
        if self.rpc_timeout_s <= 0 or self.retry_interval_s < 0:
            raise ConfigError("rpc_timeout_s must be > 0 and retry_interval_s >= 0")
        if (not isinstance(self.staging_mib, int | float) or isinstance(self.staging_mib, bool)
                or self.staging_mib <= 0):
            raise ConfigError(f"staging_mib must be a positive number, got {self.staging_mib!r}")
        if self.load_failure_policy not in {p.value for p in LoadFailurePolicy}:
            raise ConfigError(f"load_failure_policy must be one of "
                              f"{[p.value for p in LoadFailurePolicy]}, "
                              f"got {self.load_failure_policy!r}")
        t = self.load_timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 < t <= 60:
            raise ConfigError(f"load_timeout_s must be in (0, 60], got {self.load_timeout_s!r}")
        if self.replica_num < 1:
            raise ConfigError("replica_num must be >= 1")
        if not isinstance(self.client_overrides, dict):
            raise ConfigError("client_overrides must be a mapping")
