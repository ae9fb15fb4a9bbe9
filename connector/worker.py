"""Worker side of the connector: moves whole KV blocks between vLLM's paged
cache and kvpool. Imports torch but never vLLM, so it runs (and is checked on
GPUs) without vLLM installed.

Objects: one per (chunk, layer), holding the chunk's blocks of that layer
back to back. When a chunk's blocks are consecutive in a dense layer (the
usual case for a fresh allocation) the object is read/written straight
from/into the blocks (``get_into``/``put_from`` on a view, zero-copy);
otherwise whole blocks are gathered into / scattered from a staging tensor
on the cache's device.

Loads: one ``batch_get_into`` per request covering every layer of every
chunk; a chunk that fails marks its blocks as load errors (vLLM recomputes
them). Saves run on a background thread after the forward; completion is
reported per request through :meth:`KVPoolWorker.get_finished`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.layout import LayerLayout, consecutive_run
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec, SaveSpec
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess, StoreUnavailable
from kvpool.master.common import ConfigError
from kvpool.master.errors import ErrorCode, KVPoolError

__all__ = ["KVPoolWorker", "LoadResult"]

log = logging.getLogger("kvpool.connector")


@dataclass
class LoadResult:
    """Outcome of one request's load: chunks loaded and block ids that failed."""

    req_id: str
    loaded_chunks: int
    failed_block_ids: set[int]
    nbytes: int


@dataclass
class _Obj:
    key: str
    layer: LayerLayout
    block_ids: list[int]  # blocks this object covers, in order
    write_from: int  # first block (index into block_ids) to write on load
    write_to: int  # end (exclusive) of the blocks to write on load
    buf: Any  # view into the cache (zero-copy) or staging tensor
    staged: bool


class KVPoolWorker:
    """Worker-side engine. Call :meth:`register_kv_caches` once, then per step
    :meth:`start_load` (before the forward for sync loads),
    :meth:`handle_preemptions`, :meth:`submit_saves` (after the forward) and
    :meth:`get_finished` / :meth:`take_load_errors`. Close with :meth:`close`.
    """

    def __init__(self, cfg: ConnectorConfig, keys: KeySpace, store: StoreAccess,
                 stats: ConnectorStats | None = None) -> None:
        self.cfg = cfg
        self.keys = keys
        self.store = store
        self.stats = stats or ConnectorStats()
        self.layers: list[LayerLayout] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._save_futures: list[Future[None]] = []
        self._pending_saves: dict[str, int] = defaultdict(int)
        self._had_saves: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._done_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._closed = False
        store.on_connect = self._register_buffers

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, Any],
                           layer_index: dict[str, int] | None = None,
                           num_blocks: int | None = None) -> None:
        """Record the paged KV tensors (``{layer_name: tensor}``, dim 0 = blocks).

        ``layer_index`` maps names to the layer numbers used in keys (default:
        the dict's order). ``num_blocks``: the scheduler's block count, when
        vLLM split blocks into smaller kernel blocks. Layers aliasing one tensor
        (KV sharing) are stored once.
        """
        seen: dict[tuple[int, int], str] = {}
        layers = []
        for i, (name, t) in enumerate(kv_caches.items()):
            ident = (t.data_ptr(), t.storage_offset())
            if ident in seen:
                continue  # a layer reusing another layer's cache
            seen[ident] = name
            idx = layer_index[name] if layer_index is not None else i
            ratio = 1
            if num_blocks and t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0:
                ratio = int(t.shape[0]) // num_blocks
            layers.append(LayerLayout.from_tensor(name, idx, t, ratio))
        if not layers:
            raise ConfigError("no KV cache tensors to register")
        nbs = {layer.num_blocks for layer in layers}
        if len(nbs) != 1:
            raise ConfigError(f"layers disagree on num_blocks: {sorted(nbs)}")
        self.layers = sorted(layers, key=lambda lay: lay.index)
        log.info("kvpool: %d KV layers, %d blocks of %d bytes per layer (dense=%s, %s)",
                 len(self.layers), self.layers[0].num_blocks, self.layers[0].block_bytes,
                 self.layers[0].dense, self.layers[0].device)
        try:  # register now if the store is reachable; else on first connect
            self.store.client()
        except StoreUnavailable:
            pass

    def _register_buffers(self, client: Any) -> None:
        """Register each distinct backing allocation once for zero-copy transfers."""
        done: set[int] = set()
        for layer in self.layers:
            ptr = layer.storage.data_ptr()
            if ptr in done:
                continue
            done.add(ptr)
            try:
                self._handles.append(client.register_buffer(layer.storage))
            except KVPoolError as exc:  # registration is an optimisation only
                log.warning("kvpool: could not register KV cache buffer: %s", exc)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all layers of this worker."""
        return sum(lay.block_bytes for lay in self.layers) * self.keys.blocks_per_chunk

    # ------------------------------------------------------------ object plans

    def _objects(self, chunk: ChunkRef, skip: int, for_load: bool, end: int = 0) -> list[_Obj]:
        ids = chunk.block_ids
        n = len(ids)
        end = end or n
        if n != self.keys.blocks_per_chunk or not 0 <= skip < end <= n:
            raise ConfigError(f"chunk {chunk.index}: {n} blocks (expected "
                              f"{self.keys.blocks_per_chunk}), write range {skip}:{end}")
        direct = skip == 0 and end == n and consecutive_run(ids)
        out = []
        idx: Any = None  # block index tensor, made once per chunk
        for layer in self.layers:
            key = self.keys.object_key(chunk.hash, layer.index)
            if direct and layer.dense:
                buf, staged = layer.run_view(ids[0], n), False
            else:
                import torch

                buf = torch.empty(n * layer.block_bytes, dtype=torch.uint8, device=layer.device)
                if not for_load:  # gather whole blocks into the staging tensor
                    if idx is None or idx.device != layer.device:
                        idx = torch.tensor(ids, dtype=torch.long, device=layer.device)
                    torch.index_select(layer.blocks, 0, idx, out=buf.view(n, layer.block_bytes))
                staged = True
            out.append(_Obj(key, layer, ids, skip, end, buf, staged))
        return out

    # ------------------------------------------------------------ loads

    def load(self, spec: LoadSpec) -> LoadResult:
        """Load one request's chunks now (blocking). Never raises for store
        trouble: failed chunks come back as ``failed_block_ids``."""
        t0 = time.perf_counter()
        per_chunk: list[list[_Obj]] = []
        last = len(spec.chunks) - 1
        for i, chunk in enumerate(spec.chunks):
            per_chunk.append(self._objects(chunk, spec.skip_blocks if i == 0 else 0, True,
                                           spec.last_blocks if i == last else 0))
        objs = [o for group in per_chunk for o in group]
        keys = [o.key for o in objs]
        bufs = [o.buf for o in objs]
        try:
            results = self.store.call(lambda c: c.batch_get_into(keys, bufs))
        except Exception as exc:  # never fail the request: vLLM recomputes these blocks
            log.warning("kvpool: load of %s failed, recomputing: %r", spec.req_id, exc)
            results = [-int(ErrorCode.RPC_FAIL)] * len(objs)
        failed: set[int] = set()
        loaded = 0
        nbytes = 0
        k = 0
        for group in per_chunk:
            res = results[k : k + len(group)]
            k += len(group)
            ok = all(r == o.buf.numel() for r, o in zip(res, group, strict=True))
            if not ok:
                g = group[0]
                failed.update(g.block_ids[g.write_from : g.write_to])
                continue
            for o in group:
                if o.staged:
                    self._scatter(o)
            loaded += 1
            nbytes += sum(o.buf.numel() for o in group)
        zc = sum(1 for o in objs if not o.staged)
        dt = time.perf_counter() - t0
        self.stats.add(load_requests=1, loaded_chunks=loaded, loaded_bytes=nbytes,
                       load_errors=len(spec.chunks) - loaded, load_time_s=dt,
                       zero_copy_objects=zc, staged_objects=len(objs) - zc)
        return LoadResult(spec.req_id, loaded, failed, nbytes)

    @staticmethod
    def _scatter(o: _Obj) -> None:
        import torch

        layer = o.layer
        ids = o.block_ids[o.write_from : o.write_to]
        if not ids:
            return
        src = o.buf.view(len(o.block_ids), layer.block_bytes)[o.write_from : o.write_to]
        idx = torch.tensor(ids, dtype=torch.long, device=layer.device)
        layer.blocks.index_copy_(0, idx, src)

    def start_load(self, meta: ConnectorMeta) -> None:
        """Run this step's sync loads now; start async ones in the background."""
        for spec in meta.loads:
            if spec.is_async:
                self._loader.submit(self._load_async, spec)
            else:
                try:
                    failed = self.load(spec).failed_block_ids
                except Exception as exc:  # never fail the step: recompute instead
                    log.exception("kvpool: load of %s crashed: %s", spec.req_id, exc)
                    failed = {b for c in spec.chunks for b in c.block_ids if b >= 0}
                with self._lock:
                    self._load_errors |= failed

    def _load_async(self, spec: LoadSpec) -> None:
        try:
            res = self.load(spec)
            failed = res.failed_block_ids
        except Exception as exc:  # a bug must not wedge the request: recompute it
            log.exception("kvpool: async load of %s crashed: %s", spec.req_id, exc)
            failed = {b for c in spec.chunks for b in c.block_ids if b >= 0}
        with self._lock:
            self._load_errors |= failed
            self._done_loads.add(spec.req_id)

    # ------------------------------------------------------------ saves

    def submit_saves(self, meta: ConnectorMeta, ready: Any = None) -> None:
        """Queue this step's saves on the save thread. ``ready`` (a CUDA event or
        None) is waited on before reading the blocks."""
        if not meta.saves:
            return
        specs = list(meta.saves)
        with self._lock:
            for s in specs:
                self._pending_saves[s.req_id] += 1
                self._had_saves.add(s.req_id)
        fut = self._saver.submit(self._save_job, specs, ready)
        with self._lock:
            self._save_futures = [f for f in self._save_futures if not f.done()] + [fut]

    def _save_job(self, specs: list[SaveSpec], ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            self.save(specs)
        except Exception as exc:  # saving is best effort
            log.exception("kvpool: save crashed: %s", exc)
        finally:
            with self._lock:
                for s in specs:
                    self._pending_saves[s.req_id] -= 1

    def save(self, specs: Iterable[SaveSpec]) -> int:
        """Store the chunks of ``specs`` now (blocking); chunks already stored are
        skipped. Returns the number of chunks written. Never raises for store trouble."""
        t0 = time.perf_counter()
        chunks = [c for s in specs for c in s.chunks]
        if not chunks or not self.layers:
            return 0
        all_keys = [[self.keys.object_key(c.hash, lay.index) for lay in self.layers]
                    for c in chunks]
        try:
            flat = [k for ks in all_keys for k in ks]
            present = self.store.call(lambda cl: cl.batch_exists(flat))
        except Exception as exc:  # saving is best effort
            log.debug("kvpool: save skipped, store unavailable: %r", exc)
            self.stats.add(save_errors=len(chunks))
            return 0
        todo: list[tuple[ChunkRef, list[_Obj]]] = []
        skipped = 0
        k = 0
        seen: set[str] = set()
        for c, ks in zip(chunks, all_keys, strict=True):
            have = present[k : k + len(ks)]
            k += len(ks)
            if all(have) or c.hash in seen:
                skipped += 1
                continue
            seen.add(c.hash)
            objs = [o for o, h in zip(self._objects(c, 0, False), have, strict=True) if not h]
            todo.append((c, objs))
        objs = [o for _, group in todo for o in group]
        written = 0
        nbytes = 0
        errors = 0
        if objs:
            from kvpool.store import ReplicateConfig

            rc = ReplicateConfig(replica_num=self.cfg.replica_num)
            keys = [o.key for o in objs]
            bufs = [o.buf for o in objs]
            try:
                codes = self.store.call(lambda cl: cl.batch_put_from(keys, bufs, rc))
            except Exception as exc:  # saving is best effort
                log.warning("kvpool: save failed: %r", exc)
                codes = [ErrorCode.RPC_FAIL] * len(objs)
            ok_codes = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)
            i = 0
            for _, group in todo:
                res = codes[i : i + len(group)]
                i += len(group)
                if all(ErrorCode(int(r)) in ok_codes for r in res):
                    written += 1
                    nbytes += sum(o.buf.numel() for o in group)
                else:
                    errors += 1
        zc = sum(1 for o in objs if not o.staged)
        self.stats.add(saved_chunks=written, saved_bytes=nbytes, skipped_chunks=skipped,
                       save_errors=errors, save_time_s=time.perf_counter() - t0, save_batches=1,
                       zero_copy_objects=zc, staged_objects=len(objs) - zc)
        return written

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save finished; False on timeout."""
        with self._lock:
            futs = list(self._save_futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except TimeoutError:
                return False
        return True

    def handle_preemptions(self, meta: ConnectorMeta) -> None:
        """Preempted requests' blocks are about to be reused: finish pending saves."""
        if meta.preempted_req_ids:
            self.wait_saves()

    # ------------------------------------------------------------ completion

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(done_saving, done_loading)`` request ids.

        A finished request that had saves is reported once all its saves are
        done (the scheduler kept its blocks for us); async loads are reported
        when their load completed (successfully or not).
        """
        with self._lock:
            self._finished_waiting |= {r for r in finished_req_ids if r in self._had_saves}
            sending = {r for r in self._finished_waiting if self._pending_saves.get(r, 0) <= 0}
            for r in sending:
                self._finished_waiting.discard(r)
                self._had_saves.discard(r)
                self._pending_saves.pop(r, None)
            recving, self._done_loads = self._done_loads, set()
        return sending, recving

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        """Finish queued saves (bounded), stop threads, unregister buffers."""
        if self._closed:
            return
        self._closed = True
        self.wait_saves(timeout=30.0)
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        client = self.store._client
        for h in self._handles:
            try:
                if client is not None:
                    client.unregister_buffer(h)
            except Exception as exc:
                log.debug("kvpool: unregister: %s", exc)
        self._handles.clear()
