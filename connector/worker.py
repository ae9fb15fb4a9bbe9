"""Worker side of the connector: moves KV between vLLM's paged cache and kvpool,
layer group by layer group. Imports torch but never vLLM, so it runs (and is
checked on GPUs) without vLLM installed.

Objects: one per (chunk, layer group, head range) (:mod:`kvpool.connector.keys`,
byte order in :mod:`kvpool.connector.layout`). A rank writes the objects of
its own heads when it is the one rank holding them (``HeadSpec.writes``) and
reads whichever objects cover its heads, whatever TP size wrote them.

Loads (one :class:`_LoadJob` per step's sync loads): ``start_load`` issues
ONE ``batch_get_into_parts`` (one master RPC, then one transfer batch per
layer group, in layer order) on a fetch thread and returns;
``wait_for_layer(name)`` waits only for that layer's group and scatters it
into the blocks on the caller's (forward's) thread, so loading layer group
``g + 1`` overlaps computing group ``g``. A group not there by the job's
deadline fails its chunks (vLLM recomputes them); a group not scattered
before the forward ended (vLLM did not call wait_for_layer_load) fails its
chunks too. Async loads and :meth:`KVPoolWorker.load` run a job to the end
before returning.

Saves: when ``save_kv_layer`` reports the last layer of a group, that group
is ready (a CUDA event on a GPU); the save thread gathers it (its own CUDA
stream, after the event) into the save staging tensor and puts it, while the
forward goes on with later layers. Completion is reported per request
through :meth:`KVPoolWorker.get_finished`. Steps whose chunks exceed
``staging_mib`` move in batches of whole chunks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace, head_ranges, layer_ranges
from kvpool.connector.layout import LayerLayout, ObjectLayout
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec, SaveSpec, WorkerReport
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess, StoreUnavailable
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = ["HeadSpec", "KVPoolWorker", "LoadResult"]

log = logging.getLogger("kvpool.connector")

# Load staging buffers at most: one in use plus ones still held by transfers
# abandoned at their deadline (a frozen peer holds one until the store's read
# timeout, capped by the read lease).
_MAX_LOAD_BUFFERS = 3
_SAVE_WAIT_S = 120.0  # a save job waits this long for its forward's layers


def _free(held: Any) -> bool:
    """Whether a staging buffer held by ``held`` (see ``_load_bufs``) is free."""
    if held is None:
        return True
    if isinstance(held, Future):
        return held.done()
    return bool(held.query())  # a CUDA event after the kernels reading the buffer


def _release(token: Future[None] | None, _done: Any = None) -> None:
    """Resolve a staging buffer's token (the buffer may be taken again)."""
    if token is not None and not token.done():
        token.set_result(None)


def _batch_put_from(client: Any, keys: list[str], bufs: list[Any], config: Any) -> list[Any]:
    return list(client.batch_put_from(keys, bufs, config))


@dataclass(frozen=True)
class HeadSpec:
    """The global KV heads ``[first, end)`` (of ``total``) this rank holds, and
    whether it stores them (one rank per set of identical heads)."""

    first: int = 0
    end: int = 1
    total: int = 1
    writes: bool = True

    @property
    def count(self) -> int:
        return self.end - self.first


@dataclass
class LoadResult:
    """Outcome of one request's load: chunks loaded and block ids that failed."""

    req_id: str
    loaded_chunks: int
    failed_block_ids: set[int]
    nbytes: int


@dataclass
class _Chunk:
    """One chunk of a load job: where it goes and which objects cover it."""

    spec: int  # index into the job's specs
    ref: ChunkRef
    rng: tuple[int, int]  # blocks of the chunk to write
    lo: int  # global heads [lo, hi) the read objects cover (>= this rank's)
    hi: int
    ranges: list[tuple[int, int]]  # head ranges of the objects read
    failed: bool = False


@dataclass
class _LoadJob:
    specs: list[LoadSpec]
    chunks: list[_Chunk]
    deadline: float  # monotonic
    keys: list[str] = field(default_factory=list)
    bufs: list[Any] = field(default_factory=list)
    parts: list[list[int]] = field(default_factory=list)  # per group: key indices
    key_chunk: list[int] = field(default_factory=list)  # key index -> chunk index
    key_size: list[int] = field(default_factory=list)
    region: list[list[int]] = field(default_factory=list)  # [group][chunk] -> staging offset
    nbytes: int = 0
    arrived: list[threading.Event] = field(default_factory=list)
    results: dict[int, list[int]] = field(default_factory=dict)
    part_s: dict[int, float] = field(default_factory=dict)  # seconds since start, per part
    done: set[int] = field(default_factory=set)  # groups scattered (or failed)
    buf: Any = None
    token: Future[None] | None = None
    fut: Future[Any] | None = None
    started: float = 0.0
    problem: str = ""


@dataclass
class _SaveJob:
    specs: list[SaveSpec]
    ready: list[threading.Event]
    events: list[Any]  # per group: CUDA event recorded after its last layer (or None)
    seen: list[set[str]] = field(default_factory=list)


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
        self.heads = heads or HeadSpec()
        self.layers: list[LayerLayout] = []
        self.objects: ObjectLayout | None = None
        self.groups: list[list[int]] = []  # layer positions per group
        self.group_keys: list[tuple[int, int]] = []  # layer range in keys, per group
        self._group_of: dict[str, int] = {}
        self.warmup_s: float | None = None  # time of the GPU path warm-up at connect
        self._staging: dict[str, Any] = {}  # "save" / "load" -> uint8 tensor
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._fetcher = ThreadPoolExecutor(_MAX_LOAD_BUFFERS, thread_name_prefix="kvpool-fetch")
        self._save_futures: list[Future[None]] = []
        self._pending_saves: dict[str, int] = defaultdict(int)
        self._had_saves: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._done_loads: set[str] = set()
        self._load_errors: set[int] = set()
        # load staging tensors and what holds each: a token Future (a load or an
        # abandoned transfer uses it), a CUDA event (scatters still reading it) or None
        self._load_bufs: list[tuple[Any, Any]] = []
        self._active: _LoadJob | None = None  # this step's layer-wise load
        self._saving: _SaveJob | None = None  # this step's layer-wise save
        self._save_side: Any = None  # CUDA stream of the save thread
        self._layer_waits = 0
        self.layerwise = cfg.layerwise
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

        ``layer_index`` maps names to layer numbers (model order; default: the
        dict's order). ``num_blocks``: the scheduler's block count, when vLLM
        split blocks into smaller kernel blocks. Layers aliasing one tensor
        (KV sharing) are stored once; they wait for their group like the
        layer they alias.
        """
        seen: dict[tuple[int, int], str] = {}
        alias: dict[str, str] = {}
        layers = []
        for i, (name, t) in enumerate(kv_caches.items()):
            ident = (t.data_ptr(), t.storage_offset())
            if ident in seen:
                alias[name] = seen[ident]
                continue
            seen[ident] = name
            idx = layer_index[name] if layer_index is not None else i
            ratio = 1
            if num_blocks and t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0:
                ratio = int(t.shape[0]) // num_blocks
            layers.append(LayerLayout.from_tensor(name, idx, t, ratio, self.heads.count))
        if not layers:
            raise ConfigError("no KV cache tensors to register")
        nbs = {layer.num_blocks for layer in layers}
        if len(nbs) != 1:
            raise ConfigError(f"layers disagree on num_blocks: {sorted(nbs)}")
        devs = {str(layer.device) for layer in layers}
        if len(devs) != 1:
            raise ConfigError(f"KV layers on several devices: {sorted(devs)}")
        self.layers = sorted(layers, key=lambda lay: lay.index)
        if self.layers[0].heads not in (1, self.heads.count):
            raise ConfigError(f"KV cache holds {self.layers[0].heads} heads, expected "
                              f"{self.heads.count}")
        if self.layers[0].heads != self.heads.count:  # opaque blocks (MLA): one "head"
            self.heads = HeadSpec(0, 1, 1, self.heads.writes)
        self.objects = ObjectLayout(self.layers, self.keys.blocks_per_chunk)
        self.group_keys = layer_ranges(len(self.layers), self.cfg.layer_groups)
        self.groups = [list(range(a, b)) for a, b in self.group_keys]
        self._group_of = {lay.name: g for g, pos in enumerate(self.groups)
                          for lay in (self.layers[p] for p in pos)}
        for name, target in alias.items():
            self._group_of[name] = self._group_of[target]
        log.info("kvpool: %d KV layers in %d groups, %d blocks, heads %d-%d of %d (%s), "
                 "%d-byte chunks, single-kernel copies=%s, writes=%s",
                 len(self.layers), len(self.groups), self.layers[0].num_blocks,
                 self.heads.first, self.heads.end, self.heads.total, self.layers[0].device,
                 self.chunk_bytes, self.objects.single_kernel, self.heads.writes)
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
            assert self.objects is not None
            # load the gather/scatter kernels now (CUDA loads modules lazily, ~70 ms
            # on first use); reads KV blocks only, scatters into scratch memory
            self.objects.warm_up(self._staging["save"])
            client.put_from(key, self._staging["save"][:4096])
            client.get_into(key, self._staging["load"][:4096])
            client.remove(key, force=True)
            self.warmup_s = time.perf_counter() - t0
            log.info("kvpool: GPU copy path warmed up in %.3fs", self.warmup_s)
        except Exception as exc:  # only an optimisation
            log.warning("kvpool: GPU copy path warm-up failed: %r", exc)

    def _staging_bytes(self) -> int:
        """Bytes of one staging buffer: ``staging_mib``, at least one chunk."""
        return max(int(self.cfg.staging_mib * (1 << 20)), self.chunk_bytes)

    def _staging_buf(self, purpose: str, nbytes: int) -> Any:
        """The save or load staging tensor, at least ``nbytes``."""
        buf = self._staging.get(purpose)
        if buf is None or buf.numel() < nbytes:
            import torch

            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.layers[0].device)
            self._staging[purpose] = buf
        return buf

    def _group_size(self) -> int:
        """Whole chunks (all layers) that fit one staging buffer."""
        return max(1, int(self.cfg.staging_mib * (1 << 20)) // max(1, self.chunk_bytes))

    def _sync(self) -> None:
        """Wait for the kernels queued on the current stream (CUDA only)."""
        dev = self.layers[0].device
        if dev.type == "cuda":
            import torch

            torch.cuda.current_stream(dev).synchronize()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all layers and this rank's heads."""
        assert self.objects is not None
        return self.objects.object_bytes(range(len(self.layers)), self.heads.count)

    def _head_bytes(self, g: int) -> int:
        """Bytes of one head of one chunk in layer group ``g``."""
        assert self.objects is not None
        return self.objects.object_bytes(self.groups[g], 1)

    def object_key(self, chunk_hash: str, g: int, heads: tuple[int, int]) -> str:
        """Key of layer group ``g`` and global heads ``heads`` of a chunk."""
        return self.keys.object_key(chunk_hash, self.group_keys[g], heads, self.heads.total)

    # ------------------------------------------------------------ load staging

    def _load_buffer(self, nbytes: int) -> tuple[Any, Future[None]] | None:
        """A load staging tensor of >= ``nbytes`` plus the token that keeps it
        taken until resolved, or None when all ``_MAX_LOAD_BUFFERS`` are taken.
        A transfer abandoned at its deadline keeps writing into its buffer
        until the store gives up on it, so its token is resolved only then."""
        import torch

        token: Future[None] = Future()
        with self._lock:
            for i, (buf, held) in enumerate(self._load_bufs):
                if _free(held):
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

    def _free_buffer(self, buf: Any, after: Any, _done: Any = None) -> None:
        """``buf`` is free once ``after`` (a CUDA event, or None) has passed."""
        with self._lock:
            for i, (b, _held) in enumerate(self._load_bufs):
                if b is buf:
                    self._load_bufs[i] = (b, after)

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

    # ------------------------------------------------------------ loads

    def _job(self, specs: list[LoadSpec], timeout_s: float | None = None) -> _LoadJob:
        """Plan the reads of ``specs`` (validates block ranges)."""
        bpc = self.keys.blocks_per_chunk
        chunks: list[_Chunk] = []
        budget = self.cfg.load_timeout_s if timeout_s is None else timeout_s
        for si, spec in enumerate(specs):
            if timeout_s is None and spec.deadline_s > 0:
                budget = min(budget, spec.deadline_s)
            n = len(spec.chunks)
            for i, c in enumerate(spec.chunks):
                a = spec.skip_blocks if i == 0 else 0
                b = (spec.last_blocks if i == n - 1 else 0) or len(c.block_ids)
                if len(c.block_ids) != bpc or not 0 <= a < b <= bpc:
                    raise ConfigError(f"chunk {c.index}: {len(c.block_ids)} blocks "
                                      f"(expected {bpc}), write range {a}:{b}")
                k = c.head_objects or self.heads.total // self.heads.count
                if self.heads.total % k:
                    raise ConfigError(f"{self.heads.total} heads do not split into {k} objects")
                rs = [r for r in head_ranges(self.heads.total, k)
                      if r[0] < self.heads.end and r[1] > self.heads.first]
                chunks.append(_Chunk(si, c, (a, b), rs[0][0], rs[-1][1], rs))
        job = _LoadJob(specs, chunks, time.monotonic() + budget)
        off = 0
        for g in range(len(self.groups)):
            hb = self._head_bytes(g)
            part, offs = [], []
            for ci, ch in enumerate(chunks):
                offs.append(off)
                for r in ch.ranges:
                    part.append(len(job.keys))
                    job.keys.append(self.object_key(ch.ref.hash, g, r))
                    job.key_chunk.append(ci)
                    job.key_size.append((r[1] - r[0]) * hb)
                    off += (r[1] - r[0]) * hb
            job.parts.append(part)
            job.region.append(offs)
        job.nbytes = off
        job.arrived = [threading.Event() for _ in self.groups]
        return job

    def _fetch(self, job: _LoadJob) -> None:
        """Start reading ``job`` on a fetch thread (False: no staging buffer)."""
        taken = self._load_buffer(job.nbytes)
        if taken is None:
            job.problem = "found every staging buffer still in use"
            for ev in job.arrived:
                ev.set()
            return
        job.buf, job.token = taken
        pos = 0
        for size in job.key_size:
            job.bufs.append(job.buf[pos : pos + size])
            pos += size

        def on_part(p: int, results: list[int]) -> None:
            job.results[p] = results
            job.part_s[p] = time.perf_counter() - job.started
            job.arrived[p].set()

        def run() -> None:
            try:
                self.store.call(lambda c: c.batch_get_into_parts(job.keys, job.bufs,
                                                                 job.parts, on_part))
            except Exception as exc:  # never fail the request: vLLM recomputes
                job.problem = job.problem or f"failed ({exc!r})"
            finally:
                for ev in job.arrived:  # parts never reported count as failed
                    ev.set()

        job.started = time.perf_counter()
        job.fut = self._fetcher.submit(run)

    def _finish_group(self, job: _LoadJob, g: int, wait: bool = True) -> None:
        """Scatter group ``g`` of ``job`` into the blocks, or fail its chunks if
        it did not arrive (by the deadline when ``wait``)."""
        if g in job.done:
            return
        job.done.add(g)
        if wait and not job.arrived[g].is_set():
            job.arrived[g].wait(max(0.0, job.deadline - time.monotonic()))
        res = job.results.get(g) if job.arrived[g].is_set() else None
        if res is None:
            if not job.problem:
                job.problem = (f"did not finish within {job.deadline - job.started:.2f}s"
                               if not job.arrived[g].is_set() else "lost a layer group")
                if not job.arrived[g].is_set():
                    self.stats.add(load_timeouts=1)
            for ch in job.chunks:
                ch.failed = True
            return
        ok_chunks: set[int] = set(range(len(job.chunks)))
        for ki, r in zip(job.parts[g], res, strict=True):
            if r != job.key_size[ki]:
                ok_chunks.discard(job.key_chunk[ki])
        assert self.objects is not None
        hb = self._head_bytes(g)
        todo = [ci for ci, ch in enumerate(job.chunks) if not ch.failed and ci in ok_chunks]
        for ci, ch in enumerate(job.chunks):
            if ci not in ok_chunks and not ch.failed:
                ch.failed = True
                if not job.problem:
                    codes = sorted({r for r in res if r < 0})
                    job.problem = f"missed objects (codes {codes})"
        own = (self.heads.first, self.heads.end)
        h0, h1 = 0, self.heads.count
        sel = self.groups[g]
        if todo and all((job.chunks[ci].lo, job.chunks[ci].hi) == own for ci in todo) and \
                todo == list(range(todo[0], todo[0] + len(todo))):
            start = job.region[g][todo[0]]
            self.objects.scatter([job.chunks[ci].ref.block_ids for ci in todo], sel, h0, h1,
                                 job.buf[start:], [job.chunks[ci].rng for ci in todo])
        else:
            for ci in todo:
                ch = job.chunks[ci]
                start = job.region[g][ci] + (self.heads.first - ch.lo) * hb * 1
                self.objects.scatter([ch.ref.block_ids], sel, h0, h1, job.buf[start:],
                                     [ch.rng])

    def _close_job(self, job: _LoadJob) -> tuple[int, set[int], dict[str, set[int]]]:
        """After every group: sync, release the buffer, record measurements and
        stats. Returns (chunks loaded, failed blocks, failed blocks per request)."""
        # The buffer is free again once the scatters reading it ran (a CUDA
        # event: no host sync here) and no abandoned transfer writes into it.
        after = None
        if self.layers[0].device.type == "cuda":
            import torch

            after = torch.cuda.Event()
            after.record()
        if job.fut is not None and not job.fut.done():  # abandoned: its token stays
            job.fut.add_done_callback(partial(self._free_buffer, job.buf, after))
        else:
            self._free_buffer(job.buf, after)
            _release(job.token)
        failed: set[int] = set()
        per_req: dict[str, set[int]] = defaultdict(set)
        got: dict[str, int] = defaultdict(int)
        loaded = 0
        for ch in job.chunks:
            if ch.failed:
                blocks = {b for b in ch.ref.block_ids[ch.rng[0] : ch.rng[1]] if b >= 0}
                failed |= blocks
                per_req[job.specs[ch.spec].req_id] |= blocks
            else:
                loaded += 1
                if ch.ref.peer:
                    got[ch.ref.peer] += (ch.hi - ch.lo) * sum(
                        self._head_bytes(g) for g in range(len(self.groups)))
        total = sum(got.values())
        if total and job.part_s and len(job.part_s) == len(self.groups):
            secs = max(job.part_s.values())
            with self._lock:
                for peer, nbytes in got.items():
                    self._report.loads.append((peer, nbytes, secs * nbytes / total))
        if job.problem:
            peers = sorted({ch.ref.peer for ch in job.chunks if ch.failed and ch.ref.peer})
            with self._lock:
                self._report.failed_peers.extend(peers)
            for spec in job.specs:
                if per_req.get(spec.req_id):
                    self._warn_load(spec.req_id, job.problem)
        # load time: until the last layer group arrived (in a layer-wise load the
        # job closes only after the forward)
        if job.part_s and len(job.part_s) == len(self.groups):
            dt = max(job.part_s.values())
        else:
            dt = time.perf_counter() - job.started if job.started else 0.0
        nb = self.chunk_bytes
        for si, spec in enumerate(job.specs):
            mine = [ch for ch in job.chunks if ch.spec == si]
            ok = sum(not ch.failed for ch in mine)
            self.stats.add(load_requests=1, loaded_chunks=ok, loaded_bytes=ok * nb,
                           load_errors=len(mine) - ok, load_time_s=dt / len(job.specs),
                           staged_objects=len(mine))
            if spec.predicted_s is not None and ok == len(mine):
                self.stats.add(predicted_loads=1, predicted_loads_s=spec.predicted_s,
                               predicted_loads_actual_s=dt)
        return loaded, failed, per_req

    def _run_job(self, job: _LoadJob) -> tuple[int, set[int], dict[str, set[int]]]:
        """Fetch and scatter every group of ``job`` now (blocking)."""
        self._fetch(job)
        for g in range(len(self.groups)):
            self._finish_group(job, g)
        return self._close_job(job)

    def _split(self, specs: list[LoadSpec]) -> list[list[LoadSpec]]:
        """Specs in batches whose chunks fit one staging buffer (a spec larger
        than a buffer is cut into whole chunks)."""
        cap = self._group_size()
        out: list[list[LoadSpec]] = [[]]
        n = 0
        for spec in specs:
            chunks = list(spec.chunks)
            first = True
            while chunks:
                room = cap - n
                if room <= 0:
                    out.append([])
                    n, room = 0, cap
                take, chunks = chunks[:room], chunks[room:]
                part = LoadSpec(spec.req_id, take, spec.skip_blocks if first else 0,
                                spec.is_async, spec.last_blocks if not chunks else 0,
                                spec.deadline_s, spec.predicted_s if first and not chunks
                                else None)
                out[-1].append(part)
                n += len(take)
                first = False
        return [b for b in out if b]

    def load(self, spec: LoadSpec, timeout_s: float | None = None) -> LoadResult:
        """Load one request's chunks now (blocking, at most ``timeout_s``, default
        the spec's deadline or ``load_timeout_s``). Never raises for store
        trouble: chunks that failed, or were not read by the deadline, come back
        as ``failed_block_ids`` (vLLM recomputes them)."""
        if self.objects is None:
            raise ConfigError("register_kv_caches was not called")
        loaded, failed = 0, set[int]()
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        for batch in self._split([spec]):
            left = None if t_end is None else max(0.0, t_end - time.monotonic())
            n, f, _ = self._run_job(self._job(batch, left))
            loaded, failed = loaded + n, failed | f
        return LoadResult(spec.req_id, loaded, failed, loaded * self.chunk_bytes)

    def start_load(self, meta: ConnectorMeta) -> None:
        """Start this step's loads: async ones in the background; sync ones
        layer-wise (finished by :meth:`wait_for_layer`) when they fit one
        staging buffer, else now. The forward's timing (started when vLLM bound
        the metadata) restarts after loads run here."""
        self._finish_active(forward_ran=False)
        sync = [s for s in meta.loads if not s.is_async]
        for spec in meta.loads:
            if spec.is_async:
                self._loader.submit(self._load_async, spec)
        if not sync:
            return
        if self.objects is None:
            raise ConfigError("register_kv_caches was not called")
        batches = self._split(sync)
        if self.layerwise and len(batches) == 1:
            try:
                job = self._job(batches[0])
                self._fetch(job)
                self._active = job
                self._forward = None  # a forward that waits for loads is no prefill sample
                return
            except Exception as exc:  # never fail the step: recompute instead
                log.exception("kvpool: load planning crashed: %s", exc)
                self._fail_specs(sync)
                return
        for batch in batches:
            try:
                _, failed, _ = self._run_job(self._job(batch))
            except Exception as exc:  # never fail the step: recompute instead
                log.exception("kvpool: load crashed: %s", exc)
                self._fail_specs(batch)
                continue
            with self._lock:
                self._load_errors |= failed
        self.forward_started(meta)

    def _fail_specs(self, specs: list[LoadSpec]) -> None:
        with self._lock:
            for spec in specs:
                self._load_errors |= {b for c in spec.chunks for b in c.block_ids if b >= 0}

    def wait_for_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: wait for (only) the group holding this layer,
        scatter it into the blocks; groups before it too, in order."""
        job = self._active
        if job is None:
            return
        self._layer_waits += 1
        g = self._group_of.get(layer_name)
        if g is None:
            return
        try:
            for gi in range(g + 1):
                self._finish_group(job, gi)
        except Exception as exc:  # never fail the step: recompute instead
            log.exception("kvpool: layer-wise load crashed: %s", exc)
            for ch in job.chunks:
                ch.failed = True

    def _finish_active(self, forward_ran: bool) -> None:
        """Close this step's layer-wise load. Groups the forward did not wait
        for were scattered too late (their layers already ran): failed."""
        job, self._active = self._active, None
        if job is None:
            return
        late = [g for g in range(len(self.groups)) if g not in job.done]
        if late and forward_ran:
            if self._layer_waits == 0 and self.layerwise:
                log.warning("kvpool: vLLM did not call wait_for_layer_load; loading whole "
                            "requests before the forward from now on")
                self.layerwise = False
            for ch in job.chunks:
                ch.failed = True
            job.problem = job.problem or "was not waited for by its layers"
        for g in late:
            job.done.add(g)
        if not late:
            self.stats.add(layerwise_loads=1)
        self._layer_waits = 0
        try:
            _, failed, _ = self._close_job(job)
        except Exception as exc:
            log.exception("kvpool: closing a load crashed: %s", exc)
            failed = {b for ch in job.chunks for b in ch.ref.block_ids if b >= 0}
        with self._lock:
            self._load_errors |= failed

    def _load_async(self, spec: LoadSpec) -> None:
        try:
            failed = self.load(spec).failed_block_ids
        except Exception as exc:  # a bug must not wedge the request: recompute it
            log.exception("kvpool: async load of %s crashed: %s", spec.req_id, exc)
            failed = {b for c in spec.chunks for b in c.block_ids if b >= 0}
        with self._lock:
            self._load_errors |= failed
            self._done_loads.add(spec.req_id)

    # ------------------------------------------------------------ forward timing

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

    def _forward_done(self) -> None:
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

    def end_step(self, meta: ConnectorMeta | None) -> None:
        """``wait_for_save``: the forward is queued (GPU) or done (CPU). Closes
        the layer-wise load, marks every save group ready, times the forward."""
        self._finish_active(forward_ran=True)
        if meta is not None and meta.saves:
            job = self._save_job(meta)
            for g in range(len(self.groups)):
                self._mark_ready(job, g)
        self._saving = None
        self._forward_done()

    # ------------------------------------------------------------ saves

    def _save_job(self, meta: ConnectorMeta) -> _SaveJob:
        """This step's save job, created (and queued) at its first use."""
        job = self._saving
        if job is not None:
            return job
        specs = list(meta.saves)
        job = _SaveJob(specs, [threading.Event() for _ in self.groups],
                       [None] * len(self.groups), [set() for _ in self.groups])
        self._saving = job
        with self._lock:
            for s in specs:
                self._pending_saves[s.req_id] += 1
                self._had_saves.add(s.req_id)
        fut = self._saver.submit(self._run_save, job)
        with self._lock:
            self._save_futures = [f for f in self._save_futures if not f.done()] + [fut]
        return job

    def _mark_ready(self, job: _SaveJob, g: int) -> None:
        if job.ready[g].is_set():
            return
        if self.layers[0].device.type == "cuda":
            import torch

            ev = torch.cuda.Event()
            ev.record()
            job.events[g] = ev
        job.ready[g].set()

    def layer_saved(self, layer_name: str, meta: ConnectorMeta | None) -> None:
        """``save_kv_layer``: once every layer of a group has run, its objects
        are put in the background while later layers compute."""
        if meta is None or not meta.saves:
            return
        g = self._group_of.get(layer_name)
        if g is None:
            return
        job = self._save_job(meta)
        job.seen[g].add(layer_name)
        if len(job.seen[g]) >= len(self.groups[g]):
            self._mark_ready(job, g)

    def submit_saves(self, meta: ConnectorMeta, ready: Any = None) -> None:
        """Queue this step's saves now (every group ready; ``ready``: a CUDA
        event the save thread waits for before reading the blocks)."""
        if not meta.saves:
            return
        self._saving = None
        job = self._save_job(meta)
        for g in range(len(self.groups)):
            job.events[g] = ready
            job.ready[g].set()
        self._saving = None

    def _run_save(self, job: _SaveJob) -> None:
        try:
            self._save_groups(job)
        except Exception as exc:  # saving is best effort
            log.exception("kvpool: save crashed: %s", exc)
        finally:
            with self._lock:
                for s in job.specs:
                    self._pending_saves[s.req_id] -= 1

    def save(self, specs: Iterable[SaveSpec]) -> int:
        """Store the chunks of ``specs`` now (blocking). Returns the chunks
        written (every object stored); chunks already stored count as
        skipped. Never raises for store trouble."""
        todo = list(specs)
        if not todo or self.objects is None:
            return 0
        job = _SaveJob(todo, [threading.Event() for _ in self.groups],
                       [None] * len(self.groups), [set() for _ in self.groups])
        for ev in job.ready:
            ev.set()
        return self._save_groups(job)

    def _save_groups(self, job: _SaveJob) -> int:
        """Gather and put each group of ``job`` once it is ready, in order."""
        t0 = time.perf_counter()
        assert self.objects is not None
        seen: set[str] = set()
        chunks: list[ChunkRef] = []
        for s in job.specs:
            for c in s.chunks:
                if c.hash not in seen:
                    seen.add(c.hash)
                    chunks.append(c)
        for c in chunks:
            if len(c.block_ids) != self.keys.blocks_per_chunk:
                raise ConfigError(f"chunk {c.index}: {len(c.block_ids)} blocks, expected "
                                  f"{self.keys.blocks_per_chunk}")
        if not self.heads.writes or not chunks:
            return 0
        from kvpool.store import ReplicateConfig

        rc = ReplicateConfig(replica_num=self.cfg.replica_num)
        heads = (self.heads.first, self.heads.end)
        new: dict[str, int] = defaultdict(int)  # chunk hash -> objects written
        have: dict[str, int] = defaultdict(int)  # ... already stored
        errors: set[str] = set()
        batches = staged = nbytes = 0
        cap = self._group_size() * len(self.groups)  # chunks of one group per buffer
        cuda = self.layers[0].device.type == "cuda"
        for g in range(len(self.groups)):
            if not job.ready[g].wait(_SAVE_WAIT_S):
                log.warning("kvpool: save gave up waiting for layer group %d", g)
                errors.update(c.hash for c in chunks)
                break
            ob = self.objects.object_bytes(self.groups[g], self.heads.count)
            for at in range(0, len(chunks), cap):
                batch = chunks[at : at + cap]
                buf = self._staging_buf("save", len(batch) * ob)
                self._gather(job.events[g], cuda, batch, g, buf)
                keys = [self.object_key(c.hash, g, heads) for c in batch]
                bufs = [buf[i * ob : (i + 1) * ob] for i in range(len(batch))]
                batches += 1
                staged += len(batch)
                try:
                    codes = self.store.call(partial(_batch_put_from, keys=keys, bufs=bufs,
                                                    config=rc))
                except Exception as exc:  # saving is best effort
                    log.warning("kvpool: save failed: %r", exc)
                    codes = [ErrorCode.RPC_FAIL] * len(batch)
                for c, r in zip(batch, codes, strict=True):
                    code = ErrorCode(int(r))
                    if code == ErrorCode.OK:
                        new[c.hash] += 1
                        nbytes += ob
                    elif code == ErrorCode.OBJECT_ALREADY_EXISTS:
                        have[c.hash] += 1
                    else:
                        errors.add(c.hash)
        G = len(self.groups)
        written = sum(1 for c in chunks if c.hash not in errors and new[c.hash]
                      and new[c.hash] + have[c.hash] == G)
        skipped = sum(1 for c in chunks if have[c.hash] == G)
        self.stats.add(saved_chunks=written, saved_bytes=nbytes, skipped_chunks=skipped,
                       save_errors=len(errors), save_time_s=time.perf_counter() - t0,
                       save_batches=batches, staged_objects=staged)
        return written

    def _gather(self, event: Any, cuda: bool, batch: list[ChunkRef], g: int, buf: Any) -> None:
        """Gather group ``g`` of ``batch`` into ``buf`` after ``event`` (the
        forward's point where the group's KV is written)."""
        assert self.objects is not None
        ids = [c.block_ids for c in batch]
        if not cuda:
            self.objects.gather(ids, self.groups[g], 0, self.heads.count, buf)
            return
        import torch

        if self._save_side is None:
            self._save_side = torch.cuda.Stream(device=self.layers[0].device)
        with torch.cuda.stream(self._save_side):
            if event is not None:
                self._save_side.wait_event(event)
            self.objects.gather(ids, self.groups[g], 0, self.heads.count, buf)
        self._save_side.synchronize()  # gathered before the copies read the buffer

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
        if self._saving is not None:  # a forward that never ended: release its job
            for ev in self._saving.ready:
                ev.set()
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
