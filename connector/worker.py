"""Worker side of the connector: the per-step calls vLLM's worker makes,
routed to one room per job. Imports torch but never vLLM, so it runs (and
is checked on GPUs) without vLLM installed.

- :mod:`kvpool.connector.geometry`: the registered cache (layers, layer
  groups, this rank's heads, object layout and keys);
- :mod:`kvpool.connector.load`: the load pipeline (one store batch per
  step, scattered layer group by layer group as the forward reaches it);
- :mod:`kvpool.connector.save`: the save queue (groups gathered and put in
  the background as the forward finishes them);
- :mod:`kvpool.connector.staging`: the staging buffers both move through;
- :mod:`kvpool.connector.state`: recurrent (Mamba) state blocks, stored
  per checkpointed boundary beside the chunks;
- :mod:`kvpool.connector.report`: measurements for the scheduler.

Objects: one per (chunk, layer group, head range) (:mod:`kvpool.connector.keys`,
byte order in :mod:`kvpool.connector.layout`). A rank writes the objects of
its own heads when it is the one rank holding them (``HeadSpec.writes``) and
reads whichever objects cover its heads, whatever TP size wrote them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.geometry import CacheGeometry, HeadSpec
from kvpool.connector.keys import KeySpace
from kvpool.connector.layout import LayerLayout, ObjectLayout
from kvpool.connector.load import LoadPipeline, LoadResult, Started
from kvpool.connector.metadata import ConnectorMeta, LoadSpec, SaveSpec, WorkerReport
from kvpool.connector.report import StepReport
from kvpool.connector.save import SaveQueue
from kvpool.connector.staging import StagingBuffers
from kvpool.connector.state import StateCache
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess, StoreUnavailable
from kvpool.core.config import ConfigError

__all__ = ["HeadSpec", "KVPoolWorker", "LoadResult"]


class KVPoolWorker:
    """Worker-side engine. Call :meth:`register_kv_caches` once, then per step
    :meth:`start_load` (before the forward), :meth:`wait_for_layer` per layer,
    :meth:`layer_saved` per layer, :meth:`end_step` after the forward, then
    :meth:`get_finished` / :meth:`take_load_errors`. Close with :meth:`close`.
    """

    def __init__(self, cfg: ConnectorConfig, keys: KeySpace, store: StoreAccess,
                 stats: ConnectorStats | None = None, heads: HeadSpec | None = None) -> None:
        self.cfg = cfg
        self.keys = keys
        self.store = store
        self.stats = stats or ConnectorStats()
        self._heads = heads or HeadSpec()
        self.geo: CacheGeometry | None = None
        self.warmup_s: float | None = None  # time of the GPU path warm-up at connect
        self.staging = StagingBuffers(cfg.staging_mib, keys.prefix)
        self.report = StepReport()
        self.loads = LoadPipeline(cfg, store, self.stats, self.staging, self.report)
        self.saves = SaveQueue(cfg, store, self.stats, self.staging, self.report)
        self._closed = False
        store.on_connect = self._on_connect

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, Any],
                           layer_index: dict[str, int] | None = None,
                           num_blocks: int | None = None,
                           cache_group_of: dict[str, int] | None = None) -> None:
        """Record the paged KV tensors (``{layer_name: tensor}``, dim 0 = blocks)
        and each layer's vLLM KV-cache group; see :meth:`CacheGeometry.from_caches`."""
        geo = CacheGeometry.from_caches(kv_caches, self._heads, self.keys,
                                        self.cfg.layer_groups, layer_index, num_blocks,
                                        cache_group_of)
        self.geo = geo
        for room in (self.staging, self.loads, self.saves):
            room.attach(geo)
        try:  # register now if the store is reachable; else on first connect
            self.store.client()
        except StoreUnavailable:
            pass

    def register_state_caches(self, groups: list[list[tuple[str, Any]]], rank: int = 0,
                              ranks: int = 1) -> None:
        """Record the recurrent-state layers (Mamba / linear attention) of each
        state group, ``[(layer_name, tensor)]`` in model order, and this
        worker's tensor-parallel ``rank`` of ``ranks``; see :mod:`kvpool.connector.state`.
        A failed load is then reported per request (vLLM has several groups),
        also when these layers cannot be stored (ConfigError)."""
        self.loads.whole_requests = True
        states = StateCache(groups, self.keys, self.store, rank, ranks)
        self.loads.states = self.saves.states = states

    def _on_connect(self, client: Any) -> None:
        secs = self.staging.on_connect(client)
        if secs is not None:
            self.warmup_s = secs

    # ------------------------------------------------------------ the cache

    @property
    def heads(self) -> HeadSpec:
        """This rank's heads (``0-1 of 1`` once an MLA cache is registered)."""
        return self.geo.heads if self.geo is not None else self._heads

    @property
    def layers(self) -> list[LayerLayout]:
        return self.geo.layers if self.geo is not None else []

    @property
    def objects(self) -> ObjectLayout | None:
        return self.geo.objects if self.geo is not None else None

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all layers and this rank's heads."""
        if self.geo is None:
            raise ConfigError("register_kv_caches was not called")
        return self.geo.chunk_bytes

    def object_key(self, chunk_hash: str, g: int, heads: tuple[int, int]) -> str:
        """Key of layer group ``g`` and global heads ``heads`` of a chunk."""
        if self.geo is None:
            raise ConfigError("register_kv_caches was not called")
        return self.geo.object_key(chunk_hash, g, heads)

    @property
    def layerwise(self) -> bool:
        """Load layer-wise (off after vLLM skipped wait_for_layer_load once)."""
        return self.loads.layerwise

    @layerwise.setter
    def layerwise(self, on: bool) -> None:
        self.loads.layerwise = on

    # ------------------------------------------------------------ loads

    def load(self, spec: LoadSpec, timeout_s: float | None = None) -> LoadResult:
        """Load one request's chunks now (:meth:`LoadPipeline.load`)."""
        return self.loads.load(spec, timeout_s)

    def start_load(self, meta: ConnectorMeta) -> None:
        """Start this step's loads (:meth:`LoadPipeline.start`). A forward that
        waits for a layer-wise load is no prefill sample; after loads ran here
        its timing (started when vLLM bound the metadata) restarts."""
        started = self.loads.start(meta)
        if started is Started.LAYERWISE:
            self.report.discard_forward()
        elif started is Started.RAN:
            self.forward_started(meta)

    def wait_for_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load`` (:meth:`LoadPipeline.wait_for_layer`)."""
        self.loads.wait_for_layer(layer_name)

    # ------------------------------------------------------------ saves

    def layer_saved(self, layer_name: str, meta: ConnectorMeta | None) -> None:
        """``save_kv_layer`` (:meth:`SaveQueue.layer_saved`)."""
        self.saves.layer_saved(layer_name, meta)

    def submit_saves(self, meta: ConnectorMeta, ready: Any = None) -> None:
        """Queue this step's saves now (:meth:`SaveQueue.submit`)."""
        self.saves.submit(meta, ready)

    def save(self, specs: Iterable[SaveSpec]) -> int:
        """Store the chunks of ``specs`` now (:meth:`SaveQueue.save`)."""
        return self.saves.save(specs)

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save finished; False on timeout."""
        return self.saves.wait(timeout)

    def handle_preemptions(self, meta: ConnectorMeta) -> None:
        """Before the forward: preempted requests' blocks (or sliding-window
        blocks a pending save reads, ``flush_saves``) are about to be reused:
        finish pending saves."""
        if meta.preempted_req_ids or meta.flush_saves:
            self.saves.wait()

    # ------------------------------------------------------------ the step

    def forward_started(self, meta: ConnectorMeta) -> None:
        """Time this step's forward (it computes ``meta.scheduled_tokens``)."""
        self.report.forward_started(meta.scheduled_tokens,
                                    self.geo.cuda if self.geo is not None else None)

    def end_step(self, meta: ConnectorMeta | None) -> None:
        """``wait_for_save``: the forward is queued (GPU) or done (CPU). Closes
        the layer-wise load, marks every save group ready, times the forward."""
        self.loads.finish_step(forward_ran=True)
        self.saves.end_step(meta)
        self.report.forward_done()

    def take_report(self) -> WorkerReport | None:
        """Measurements since the last call (``build_connector_worker_meta``)."""
        return self.report.take()

    def get_finished(self, finished_req_ids: set[str],
                     idle: bool = False) -> tuple[set[str], set[str]]:
        """``(done_saving, done_loading)`` request ids.

        A finished request that had saves is reported once all its saves are
        done (the scheduler kept its blocks for us); async loads are reported
        when their load completed (successfully or not). ``idle``: the step
        ran no forward (:meth:`LoadPipeline.take_done_async` then waits
        briefly for a pending async load).
        """
        return (self.saves.take_finished(finished_req_ids),
                self.loads.take_done_async(idle))

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call, for a model with
        several KV-cache groups (:meth:`LoadPipeline.take_failed_requests`)."""
        return self.loads.take_failed_requests()

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        return self.loads.take_errors()

    def close(self) -> None:
        """Finish queued saves (bounded), stop threads, unregister buffers."""
        if self._closed:
            return
        self._closed = True
        self.saves.close()
        self.loads.close()
        self.staging.unregister(self.store._client)
