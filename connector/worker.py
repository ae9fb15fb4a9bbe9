"""Worker side of the connector: moves whole KV blocks between vLLM's paged
cache and kvpool. Imports torch but never vLLM, so it runs (and is checked on
GPUs) without vLLM installed.

Objects: one per chunk, holding the chunk's blocks of every layer of this
worker, layer-major (:class:`~kvpool.connector.layout.ChunkLayout`). Saves
gather the blocks of a group of chunks into a contiguous staging tensor on
the cache's device (one ``index_select`` when all layers share one
allocation, as vLLM allocates them) and put each chunk with one copy
(``batch_put_from``; on a GPU one cudaMemcpy per chunk into the registered
shm segment). Loads get each chunk into the staging tensor with one copy
(``batch_get_into``) and scatter it into the allocated blocks with one
``index_copy_``. Per-block or per-layer copies would be bound by per-call
overhead on a GPU (~6 GB/s at 64 KiB per copy).

Requests larger than ``staging_mib`` move in groups of whole chunks. A
chunk that fails to load marks its blocks as load errors (vLLM recomputes
them). Saves run on a background thread after the forward; completion is
reported per request through :meth:`KVPoolWorker.get_finished`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.layout import ChunkLayout, LayerLayout
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec, SaveSpec, WorkerReport
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess, StoreUnavailable
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = ["KVPoolWorker", "LoadResult"]

log = logging.getLogger("kvpool.connector")

# Load staging buffers at most: one in use plus ones still held by transfers
# abandoned at their deadline (a frozen peer holds one until the store's read
# timeout, capped by the read lease).
_MAX_LOAD_BUFFERS = 3


def _release(token: Future[None] | None, _done: Any = None) -> None:
    """Resolve a staging buffer's token (the buffer may be taken again)."""
    if token is not None and not token.done():
        token.set_result(None)


def _batch_get_into(client: Any, keys: list[str], bufs: list[Any]) -> list[int]:
    return list(client.batch_get_into(keys, bufs))


def _batch_put_from(client: Any, keys: list[str], bufs: list[Any], config: Any) -> list[Any]:
    return list(client.batch_put_from(keys, bufs, config))


@dataclass
class LoadResult:
    """Outcome of one request's load: chunks loaded and block ids that failed."""

    req_id: str
    loaded_chunks: int
    failed_block_ids: set[int]
    nbytes: int


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
        self.chunk_layout: ChunkLayout | None = None
        self.warmup_s: float | None = None  # time of the GPU path warm-up at connect
        self._staging: dict[str, Any] = {}  # "save" / "load" -> uint8 tensor
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
        # load staging tensors, each with the transfer (future) writing into it
        self._load_bufs: list[tuple[Any, Future[Any] | None]] = []
        self._fetcher = ThreadPoolExecutor(_MAX_LOAD_BUFFERS, thread_name_prefix="kvpool-fetch")
        self._warn_next = 0.0
        self._warn_suppressed = 0
        self._report = WorkerReport()  # measurements not yet sent to the scheduler
        self._forward: tuple[int, Any, Any] | None = None  # (tokens, start, end) timing
        self._closed = False
        store.on_connect = self._register_buffers

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, Any],
                           layer_index: dict[str, int] | None = None,
                           num_blocks: int | None = None) -> None:
        """Record the paged KV tensors (``{layer_name: tensor}``, dim 0 = blocks).

        ``layer_index`` maps names to layer numbers (the order of layers in a
        chunk object; default: the dict's order). ``num_blocks``: the
        scheduler's block count, when vLLM split blocks into smaller kernel
        blocks. Layers aliasing one tensor (KV sharing) are stored once.
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
        devs = {str(layer.device) for layer in layers}
        if len(devs) != 1:
            raise ConfigError(f"KV layers on several devices: {sorted(devs)}")
        self.layers = sorted(layers, key=lambda lay: lay.index)
        self.chunk_layout = ChunkLayout(self.layers, self.keys.blocks_per_chunk)
        log.info("kvpool: %d KV layers, %d blocks of %d bytes per layer (dense=%s, %s), "
                 "%d-byte chunk objects, single-kernel gather=%s",
                 len(self.layers), self.layers[0].num_blocks, self.layers[0].block_bytes,
                 self.layers[0].dense, self.layers[0].device, self.chunk_layout.object_bytes,
                 self.chunk_layout.single_kernel)
        try:  # register now if the store is reachable; else on first connect
            self.store.client()
        except StoreUnavailable:
            pass

    def _register_buffers(self, client: Any) -> None:
        """On connect: on a GPU, allocate the staging buffers, register them and
        warm the copy path (maps and page-locks the same-host segment once, at
        startup instead of in the first request)."""
        if not self.layers or self.layers[0].device.type != "cuda":
            return
        for purpose in ("save", "load"):
            buf = self._staging_buf(purpose, self._staging_bytes())
            try:
                self._handles.append(client.register_buffer(buf))
            except KVPoolError as exc:  # registration is an optimisation only
                log.warning("kvpool: could not register the staging buffer: %s", exc)
        with self._lock:
            self._load_bufs = [(self._staging["load"], None)]
        t0 = time.perf_counter()
        key = f"{self.keys.prefix}/warmup/{uuid.uuid4().hex}"
        try:
            assert self.chunk_layout is not None
            # load the gather/scatter kernels now (CUDA loads modules lazily, ~70 ms
            # on first use); reads KV blocks only, scatters into scratch memory
            self.chunk_layout.warm_up(self._staging["save"])
            client.put_from(key, self._staging["save"][:4096])
            client.get_into(key, self._staging["load"][:4096])
            client.remove(key, force=True)
            self.warmup_s = time.perf_counter() - t0
            log.info("kvpool: GPU copy path warmed up in %.3fs", self.warmup_s)
        except Exception as exc:  # only an optimisation
            log.warning("kvpool: GPU copy path warm-up failed: %r", exc)

    def _staging_bytes(self) -> int:
        """Bytes of a full group of chunk objects (one staging buffer)."""
        assert self.chunk_layout is not None
        return self._group_size() * self.chunk_layout.object_bytes

    def _staging_buf(self, purpose: str, nbytes: int) -> Any:
        """The save or load staging tensor, at least ``nbytes`` (grown on demand
        up to :meth:`_staging_bytes`)."""
        buf = self._staging.get(purpose)
        if buf is None or buf.numel() < nbytes:
            import torch

            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.layers[0].device)
            self._staging[purpose] = buf
        return buf

    def _group_size(self) -> int:
        """Chunks moved per store batch (what fits the staging buffer)."""
        assert self.chunk_layout is not None
        return max(1, int(self.cfg.staging_mib * (1 << 20)) // self.chunk_layout.object_bytes)

    def _sync(self) -> None:
        """Wait for the kernels queued on the current stream (CUDA only)."""
        dev = self.layers[0].device
        if dev.type == "cuda":
            import torch

            torch.cuda.current_stream(dev).synchronize()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all layers of this worker (one stored object)."""
        return sum(lay.block_bytes for lay in self.layers) * self.keys.blocks_per_chunk

    # ------------------------------------------------------------ loads

    def _load_buffer(self, nbytes: int) -> tuple[Any, Future[None]] | None:
        """A load staging tensor of >= ``nbytes`` plus the token that keeps it
        taken until resolved (``token.set_result(None)``), or None when all
        ``_MAX_LOAD_BUFFERS`` are taken. A transfer abandoned at its deadline
        keeps writing into its buffer until the store gives up on it, so its
        token is resolved only when that transfer returns."""
        import torch

        token: Future[None] = Future()
        with self._lock:
            for i, (buf, held) in enumerate(self._load_bufs):
                if held is None or held.done():
                    if buf.numel() < nbytes:
                        buf = torch.empty(nbytes, dtype=torch.uint8,
                                          device=self.layers[0].device)
                        if i == 0:
                            self._staging["load"] = buf
                    self._load_bufs[i] = (buf, token)
                    return buf, token
            if len(self._load_bufs) >= _MAX_LOAD_BUFFERS:
                return None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.layers[0].device)
            self._load_bufs.append((buf, token))
            return buf, token

    def _warn_load(self, req_id: str, what: str) -> None:
        """WARNING for a load that will be recomputed (at most one line per 10 s;
        the others are counted into the next line)."""
        now = time.monotonic()
        with self._lock:
            self._warn_suppressed += 1
            if now < self._warn_next:
                return
            n, self._warn_suppressed = self._warn_suppressed, 0
            self._warn_next = now + 10.0
        log.warning("kvpool: load of %s %s; its blocks are recomputed (%d such load(s) "
                    "since the last warning)", req_id, what, n)

    def load(self, spec: LoadSpec, timeout_s: float | None = None) -> LoadResult:
        """Load one request's chunks now (blocking, at most ``timeout_s``, default
        ``load_timeout_s``). Never raises for store trouble: chunks that failed,
        or were not read by the deadline, come back as ``failed_block_ids``
        (vLLM recomputes them)."""
        t0 = time.perf_counter()
        budget = timeout_s if timeout_s is not None else (
            min(spec.deadline_s, self.cfg.load_timeout_s) if spec.deadline_s > 0
            else self.cfg.load_timeout_s)
        deadline = time.monotonic() + budget
        cl = self.chunk_layout
        if cl is None:
            raise ConfigError("register_kv_caches was not called")
        n = len(spec.chunks)
        ranges = []
        for i, chunk in enumerate(spec.chunks):
            a = spec.skip_blocks if i == 0 else 0
            b = (spec.last_blocks if i == n - 1 else 0) or len(chunk.block_ids)
            if len(chunk.block_ids) != self.keys.blocks_per_chunk or not 0 <= a < b <= len(
                    chunk.block_ids):
                raise ConfigError(f"chunk {chunk.index}: {len(chunk.block_ids)} blocks "
                                  f"(expected {self.keys.blocks_per_chunk}), write range {a}:{b}")
            ranges.append((a, b))
        ob = cl.object_bytes
        failed: set[int] = set()
        loaded = 0
        problem = ""
        g = self._group_size()
        # Chunks after a failed one are not loaded: vLLM recomputes from the first
        # failed block on anyway.
        for s in range(0, n, g):
            group = spec.chunks[s : s + g]
            rng = ranges[s : s + g]
            left = deadline - time.monotonic()
            taken = self._load_buffer(len(group) * ob) if left > 0 and not problem else None
            if taken is None:
                problem = problem or ("ran past its deadline" if left <= 0
                                      else "found every staging buffer still in use")
                for i, c in enumerate(group):
                    failed.update(b for b in c.block_ids[rng[i][0] : rng[i][1]] if b >= 0)
                continue
            buf, token_or_none = taken
            token: Future[None] | None = token_or_none
            keys = [self.keys.chunk_key(c.hash) for c in group]
            bufs = [buf[i * ob : (i + 1) * ob] for i in range(len(group))]
            fut = self._fetcher.submit(self.store.call,
                                       partial(_batch_get_into, keys=keys, bufs=bufs))
            tg = time.perf_counter()
            try:
                results = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                self._measured(group, results, ob, time.perf_counter() - tg)
            except FutureTimeout:
                problem = f"did not finish within {budget:.2f}s"
                results = [-int(ErrorCode.TIMEOUT)] * len(group)
                self.stats.add(load_timeouts=1)
                # the buffer stays taken until the abandoned transfer returns
                fut.add_done_callback(partial(_release, token))
                token = None
            except Exception as exc:  # never fail the request: vLLM recomputes
                problem = f"failed ({exc!r})"
                results = [-int(ErrorCode.RPC_FAIL)] * len(group)
            try:
                loaded += self._scatter_loaded(group, rng, buf, results, failed)
            finally:
                if token is not None:
                    token.set_result(None)
            if not problem and len(results) and any(r != ob for r in results):
                codes = sorted({int(r) for r in results if r != ob})
                problem = f"missed {sum(r != ob for r in results)} of {len(group)} chunks " \
                          f"(codes {codes})"
        if problem:
            self._warn_load(spec.req_id, problem)
            peers = {c.peer for c in spec.chunks if c.peer}
            with self._lock:
                self._report.failed_peers.extend(sorted(peers))
        dt = time.perf_counter() - t0
        self.stats.add(load_requests=1, loaded_chunks=loaded, loaded_bytes=loaded * ob,
                       load_errors=n - loaded, load_time_s=dt, staged_objects=n)
        if spec.predicted_s is not None and not problem:
            self.stats.add(predicted_loads=1, predicted_loads_s=spec.predicted_s,
                           predicted_loads_actual_s=dt)
        return LoadResult(spec.req_id, loaded, failed, loaded * ob)

    def _measured(self, group: list[ChunkRef], results: list[int], ob: int,
                  seconds: float) -> None:
        """Record the throughput of one store batch per peer (time split by bytes)."""
        got: dict[str, int] = defaultdict(int)
        for c, r in zip(group, results, strict=True):
            if r == ob and c.peer:
                got[c.peer] += ob
        total = sum(got.values())
        if not total:
            return
        with self._lock:
            for peer, nbytes in got.items():
                self._report.loads.append((peer, nbytes, seconds * nbytes / total))

    def forward_started(self, meta: ConnectorMeta) -> None:
        """Time this step's forward (it computes ``meta.scheduled_tokens``): CUDA
        events on a GPU (read later, never synchronised here), else the clock."""
        if not meta.scheduled_tokens or not self.layers:
            self._forward = None
            return
        if self.layers[0].device.type == "cuda":
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._forward = (meta.scheduled_tokens, start, None)
        else:
            self._forward = (meta.scheduled_tokens, time.perf_counter(), None)

    def forward_done(self) -> None:
        """The forward's work is queued (GPU) or done (CPU): close its timing."""
        fw = self._forward
        if fw is None or fw[2] is not None:
            return
        tokens, start, _ = fw
        if isinstance(start, float):
            self._forward = None
            with self._lock:
                self._report.forwards.append((tokens, time.perf_counter() - start))
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._forward = (tokens, start, end)

    def take_report(self) -> WorkerReport | None:
        """Measurements since the last call (``build_connector_worker_meta``)."""
        fw = self._forward
        if fw is not None and fw[2] is not None and fw[2].query():
            self._forward = None
            with self._lock:
                self._report.forwards.append((fw[0], fw[1].elapsed_time(fw[2]) / 1000.0))
        with self._lock:
            if self._report.is_empty():
                return None
            out, self._report = self._report, WorkerReport()
        return out

    def _scatter_loaded(self, group: list[ChunkRef], rng: list[tuple[int, int]], buf: Any,
                        results: list[int], failed: set[int]) -> int:
        """Write the chunks of ``group`` that arrived whole into their blocks; add
        the others' blocks to ``failed``. Returns the chunks written."""
        assert self.chunk_layout is not None
        cl = self.chunk_layout
        ob = cl.object_bytes
        ok = [i for i, r in enumerate(results) if r == ob]
        for i, c in enumerate(group):
            if results[i] != ob:
                failed.update(b for b in c.block_ids[rng[i][0] : rng[i][1]] if b >= 0)
        if not ok:
            return 0
        if len(ok) == len(group):
            cl.scatter([c.block_ids for c in group], buf, rng)
        else:
            import torch

            sel = torch.tensor(ok, dtype=torch.long, device=buf.device)
            src = buf[: len(group) * ob].view(len(group), ob).index_select(0, sel)
            cl.scatter([group[i].block_ids for i in ok], src.view(-1), [rng[i] for i in ok])
        self._sync()  # blocks written before the buffer is reused / reported
        return len(ok)

    def start_load(self, meta: ConnectorMeta) -> None:
        """Run this step's sync loads now; start async ones in the background.
        The forward's timing (started when vLLM bound the metadata) restarts
        after sync loads, so it measures compute only."""
        self._start_loads(meta)
        if any(not s.is_async for s in meta.loads):
            self.forward_started(meta)

    def _start_loads(self, meta: ConnectorMeta) -> None:
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
        cl = self.chunk_layout
        if not chunks or cl is None:
            return 0
        keys = [self.keys.chunk_key(c.hash) for c in chunks]
        try:
            present = self.store.call(lambda cl_: cl_.batch_exists(keys))
        except Exception as exc:  # saving is best effort
            log.debug("kvpool: save skipped, store unavailable: %r", exc)
            self.stats.add(save_errors=len(chunks))
            return 0
        todo: list[tuple[ChunkRef, str]] = []
        seen: set[str] = set()
        for c, k, have in zip(chunks, keys, present, strict=True):
            if have or k in seen:
                continue
            if len(c.block_ids) != self.keys.blocks_per_chunk:
                raise ConfigError(f"chunk {c.index}: {len(c.block_ids)} blocks, expected "
                                  f"{self.keys.blocks_per_chunk}")
            seen.add(k)
            todo.append((c, k))
        skipped = len(chunks) - len(todo)
        ob = cl.object_bytes
        written = errors = batches = 0
        g = self._group_size()
        if todo:
            from kvpool.store import ReplicateConfig

            rc = ReplicateConfig(replica_num=self.cfg.replica_num)
            ok_codes = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)
            for s in range(0, len(todo), g):
                group = todo[s : s + g]
                buf = self._staging_buf("save", len(group) * ob)
                cl.gather([c.block_ids for c, _ in group], buf)
                self._sync()  # gathered before the copies read the staging buffer
                gkeys = [k for _, k in group]
                bufs = [buf[i * ob : (i + 1) * ob] for i in range(len(group))]
                batches += 1
                try:
                    codes = self.store.call(
                        partial(_batch_put_from, keys=gkeys, bufs=bufs, config=rc))
                except Exception as exc:  # saving is best effort
                    log.warning("kvpool: save failed: %r", exc)
                    codes = [ErrorCode.RPC_FAIL] * len(group)
                for r in codes:
                    if ErrorCode(int(r)) in ok_codes:
                        written += 1
                    else:
                        errors += 1
        self.stats.add(saved_chunks=written, saved_bytes=written * ob, skipped_chunks=skipped,
                       save_errors=errors, save_time_s=time.perf_counter() - t0,
                       save_batches=batches, staged_objects=len(todo))
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
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        client = self.store._client
        for h in self._handles:
            try:
                if client is not None:
                    client.unregister_buffer(h)
            except Exception as exc:
                log.debug("kvpool: unregister: %s", exc)
        self._handles.clear()
