"""The save queue: vLLM's paged KV blocks into pool objects, in the background.

When ``save_kv_layer`` reports the last layer of a group, that group is
ready (a CUDA event on a GPU); the save thread gathers it (its own CUDA
stream, after the event) into the save staging tensor and puts it, while the
forward goes on with later layers. Steps whose chunks exceed ``staging_mib``
move in batches of whole chunks. A rank writes only the heads it is the one
rank holding (``HeadSpec.writes``). Completion is reported per request
(:meth:`SaveQueue.take_finished`: vLLM keeps a finished request's blocks
until its saves are done). With several vLLM KV-cache groups, a layer group
stores a chunk only when the request holds all its blocks in that group (a
sliding window's blocks outside the window are -1: vLLM freed them).
Saving is best effort: store trouble is counted, never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.geometry import CacheGeometry
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, SaveSpec
from kvpool.connector.report import StepReport
from kvpool.connector.staging import StagingBuffers, StagingViews
from kvpool.connector.state import StateCache
from kvpool.connector.stats import ConnectorStats
from kvpool.connector.store_access import StoreAccess, put_from_ready
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode

__all__ = ["SaveJob", "SaveQueue"]

log = logging.getLogger("kvpool.connector")

_SAVE_WAIT_S = 120.0  # a save job waits this long for its forward's layers


@dataclass
class SaveJob:
    """One step's saves: which groups are ready, and after which CUDA event."""

    specs: list[SaveSpec]
    ready: list[threading.Event]
    events: list[Any]  # per group: CUDA event recorded after its last layer (or None)
    seen: list[set[str]] = field(default_factory=list)  # layers of each group saved
    # the forward ended (recurrent states are read after it), and its CUDA event
    ended: threading.Event = field(default_factory=threading.Event)
    end_event: Any = None


class SaveQueue:
    """Queues, gathers and puts saves (see the module docstring)."""

    def __init__(self, cfg: ConnectorConfig, store: StoreAccess, stats: ConnectorStats,
                 staging: StagingBuffers, report: StepReport | None = None) -> None:
        self.cfg = cfg
        self.report = report or StepReport()
        self.store = store
        self.stats = stats
        self.staging = staging
        self.geo: CacheGeometry | None = None
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._futures: list[Future[None]] = []
        self._pending: dict[str, int] = defaultdict(int)  # request -> save jobs not done
        self._had_saves: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._step: SaveJob | None = None  # this step's layer-wise save
        self._side: Any = None  # CUDA stream of the save thread
        self.states: StateCache | None = None

    def attach(self, geo: CacheGeometry) -> None:
        self.geo = geo

    def _new_job(self, specs: list[SaveSpec]) -> SaveJob:
        n = len(self.geo.groups) if self.geo is not None else 0
        return SaveJob(specs, [threading.Event() for _ in range(n)], [None] * n,
                       [set() for _ in range(n)])

    # ------------------------------------------------------------ a step's saves

    def step_job(self, meta: ConnectorMeta) -> SaveJob:
        """This step's save job, created (and queued) at its first use."""
        job = self._step
        if job is not None:
            return job
        job = self._new_job(list(meta.saves))
        self._step = job
        with self._lock:
            for s in job.specs:
                self._pending[s.req_id] += 1
                self._had_saves.add(s.req_id)
        fut = self._saver.submit(self._run, job)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [fut]
        return job

    def _mark_ready(self, job: SaveJob, g: int) -> None:
        if job.ready[g].is_set():
            return
        if self.geo is not None and self.geo.cuda:
            import torch

            ev = torch.cuda.Event()
            ev.record()
            job.events[g] = ev
        job.ready[g].set()

    def layer_saved(self, layer_name: str, meta: ConnectorMeta | None) -> None:
        """``save_kv_layer``: once every layer of a group has run, its objects
        are put in the background while later layers compute."""
        if meta is None or not meta.saves or self.geo is None:
            return
        g = self.geo.group_of.get(layer_name)
        if g is None:
            return
        job = self.step_job(meta)
        job.seen[g].add(layer_name)
        if len(job.seen[g]) >= len(self.geo.groups[g]):
            self._mark_ready(job, g)

    def end_step(self, meta: ConnectorMeta | None) -> None:
        """``wait_for_save``: every group of the step's saves is ready."""
        if meta is not None and meta.saves:
            job = self.step_job(meta)
            for g in range(len(job.ready)):
                self._mark_ready(job, g)
            if self.geo is not None and self.geo.cuda:
                import torch

                job.end_event = torch.cuda.Event()
                job.end_event.record()
            job.ended.set()
        self._step = None

    def submit(self, meta: ConnectorMeta, ready: Any = None) -> None:
        """Queue this step's saves now (every group ready; ``ready``: a CUDA
        event the save thread waits for before reading the blocks)."""
        if not meta.saves:
            return
        self._step = None
        job = self.step_job(meta)
        for g in range(len(job.ready)):
            job.events[g] = ready
            job.ready[g].set()
        job.end_event = ready
        job.ended.set()
        self._step = None

    def _run(self, job: SaveJob) -> None:
        try:
            self._save_groups(job)
        except Exception as exc:  # saving is best effort
            log.exception("kvpool: save crashed: %s", exc)
        finally:
            with self._lock:
                for s in job.specs:
                    self._pending[s.req_id] -= 1

    # ------------------------------------------------------------ the work

    def save(self, specs: Iterable[SaveSpec]) -> int:
        """Store the chunks of ``specs`` now (blocking). Returns the chunks
        written (every object stored); chunks already stored count as
        skipped. Never raises for store trouble."""
        todo = list(specs)
        if not todo or self.geo is None:
            return 0
        job = self._new_job(todo)
        for ev in job.ready:
            ev.set()
        job.ended.set()
        return self._save_groups(job)

    def _save_groups(self, job: SaveJob) -> int:
        """Gather and put each group of ``job`` once it is ready, in order;
        then the recurrent states, once the forward ended."""
        t0 = time.perf_counter()
        written, ran = self._save_chunks(job)
        states = [r for s in job.specs for r in s.states]
        if states:
            if self.states is not None:
                ran = self._save_states(job, states) or ran
            # the blocks are read (or never will be): the scheduler may unpin them
            self.report.add_states_saved([r.pin for r in states if r.pin >= 0])
        if ran:
            self.stats.sample("save_seconds", time.perf_counter() - t0)
        return written

    def _save_states(self, job: SaveJob, states: list[Any]) -> bool:
        """Put the checkpointed states of ``job`` (read from their blocks once
        the forward that wrote them finished). False when it gave up waiting."""
        assert self.states is not None
        if not job.ended.wait(_SAVE_WAIT_S):
            log.warning("kvpool: state save gave up waiting for the forward")
            self.stats.add(save_errors=1)
            return False
        if job.end_event is not None:
            job.end_event.synchronize()
        from kvpool.store import ReplicateConfig

        t0 = time.perf_counter()
        unique = list({(r.group, r.hash): r for r in states}.values())
        rc = ReplicateConfig(replica_num=self.cfg.replica_num)
        new, have, failed, nbytes = self.states.save(unique, rc)
        self.stats.add(saved_states=new, skipped_states=have, save_errors=int(failed > 0),
                       saved_bytes=nbytes, save_time_s=time.perf_counter() - t0)
        return True

    def _save_chunks(self, job: SaveJob) -> tuple[int, bool]:
        """The chunk part of :meth:`_save_groups`: the chunks written, and
        whether any chunk was tried."""
        t0 = time.perf_counter()
        geo = self.geo
        assert geo is not None
        seen: set[str] = set()
        chunks: list[ChunkRef] = []
        for s in job.specs:
            for c in s.chunks:
                if c.hash not in seen:
                    seen.add(c.hash)
                    chunks.append(c)
        bpc = geo.keys.blocks_per_chunk * geo.num_cache_groups
        for c in chunks:
            if len(c.block_ids) != bpc:
                raise ConfigError(f"chunk {c.index}: {len(c.block_ids)} blocks, expected {bpc}")
        if not geo.heads.writes or not chunks:
            return 0, False
        from kvpool.store import ReplicateConfig

        rc = ReplicateConfig(replica_num=self.cfg.replica_num)
        heads = (geo.heads.first, geo.heads.end)
        new: dict[str, int] = defaultdict(int)  # chunk hash -> objects written
        have: dict[str, int] = defaultdict(int)  # ... already stored
        errors: set[str] = set()
        tried: dict[str, int] = defaultdict(int)  # chunk hash -> objects attempted
        batches = staged = nbytes = 0
        # chunks of one group per buffer
        cap = geo.chunks_per_buffer(self.cfg.staging_mib) * len(geo.groups)
        for g in range(len(geo.groups)):
            if not job.ready[g].wait(_SAVE_WAIT_S):
                log.warning("kvpool: save gave up waiting for layer group %d", g)
                errors.update(c.hash for c in chunks)
                break
            ob = geo.objects.object_bytes(geo.groups[g], geo.heads.count)
            held = [c for c in chunks if min(geo.blocks(c.block_ids, g)) >= 0]
            for c in held:
                tried[c.hash] += 1
            for at in range(0, len(held), cap):
                batch = held[at : at + cap]
                buf = self.staging.save_buffer(len(batch) * ob)
                self._gather(job.events[g], batch, g, buf)
                keys = [geo.object_key(c.hash, g, heads) for c in batch]
                bufs: Sequence[Any] = (StagingViews(buf, [ob] * len(batch)) if geo.cuda
                                       else [buf[i * ob : (i + 1) * ob] for i in range(len(batch))])
                batches += 1
                staged += len(batch)
                try:
                    codes = self.store.call(partial(put_from_ready, keys=keys, bufs=bufs,
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
        written = sum(1 for c in chunks if c.hash not in errors and new[c.hash]
                      and new[c.hash] + have[c.hash] == tried[c.hash])
        skipped = sum(1 for c in chunks if tried[c.hash] and have[c.hash] == tried[c.hash])
        took = time.perf_counter() - t0
        self.stats.add(saved_chunks=written, saved_bytes=nbytes, skipped_chunks=skipped,
                       save_errors=len(errors), save_time_s=took,
                       save_batches=batches, staged_objects=staged)
        return written, True

    def _gather(self, event: Any, batch: list[ChunkRef], g: int, buf: Any) -> None:
        """Gather group ``g`` of ``batch`` into ``buf`` after ``event`` (the
        forward's point where the group's KV is written)."""
        geo = self.geo
        assert geo is not None
        ids = [geo.blocks(c.block_ids, g) for c in batch]
        if not geo.cuda:
            geo.objects.gather(ids, geo.groups[g], 0, geo.heads.count, buf)
            return
        import torch

        if self._side is None:
            self._side = torch.cuda.Stream(device=geo.device)
        with torch.cuda.stream(self._side):
            if event is not None:
                self._side.wait_event(event)
            geo.objects.gather(ids, geo.groups[g], 0, geo.heads.count, buf)
        self._side.synchronize()  # gathered before the copies read the buffer

    # ------------------------------------------------------------ completion

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued save finished; False on timeout."""
        with self._lock:
            futs = list(self._futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except TimeoutError:
                return False
        return True

    def take_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves are all done (each reported once)."""
        with self._lock:
            self._finished_waiting |= {r for r in finished_req_ids if r in self._had_saves}
            sending = {r for r in self._finished_waiting if self._pending.get(r, 0) <= 0}
            for r in sending:
                self._finished_waiting.discard(r)
                self._had_saves.discard(r)
                self._pending.pop(r, None)
        return sending

    def close(self) -> None:
        """Finish queued saves (at most 30 s), stop the save thread."""
        if self._step is not None:  # a forward that never ended: release its job
            for ev in self._step.ready:
                ev.set()
        self.wait(timeout=30.0)
        self._saver.shutdown(wait=True)
