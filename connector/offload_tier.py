"""kvpool as a secondary tier of vLLM's native offloading.

vLLM's ``OffloadingConnector`` with the tiering spec stages KV chunks in a CPU
primary tier and cascades every stored chunk to its secondary tiers; a chunk
missing from the CPU tier is looked up in them and promoted back. This
module is such a tier, loaded by ``module_path`` (docs/vllm.md)::

    "secondary_tiers": [{"type": "KVPoolTier",
                         "module_path": "kvpool.connector.offload_tier",
                         "master_address": "10.0.0.1:50051"}]

Every method of :class:`KVPoolTier` runs on the scheduler thread and returns
at once; the pool is reached only from worker threads:

- lookups: the chunks asked about during a step are sent, at the step's end
  (``on_schedule_end``), as one ``batch_locate`` to the master (with at most
  one such call in flight); until the answer comes a lookup is RETRY. A
  chunk whose put is in flight (this tier's own store, or the master says
  another engine's put has not ended) is RETRY too, for at most
  ``lookup_wait_s``; then, as for a master that does not answer, a miss.
- stores and loads: one ``batch_put_from`` / ``batch_get_into`` per job,
  straight between the rows of the CPU tier's memory and the pool (no copy in
  this process), on their own thread pools so loads never queue behind stores.
  A store beyond ``max_inflight_stores`` jobs or ``max_inflight_mib`` bytes
  in flight is dropped at once (backpressure: reported failed, the chunk
  stays in the CPU tier only); vLLM's own backpressure detector, when
  configured, sees every store's latency. A loaded chunk counts only when the
  pool gave exactly one CPU-tier row of bytes.

The pool's client is the connector's
(:class:`~kvpool.connector.store_access.StoreAccess`): connected lazily,
and after a failure skipped for ``retry_interval_s`` (lookups answer miss,
stores are dropped, loads fail) so a dead pool never stalls the engine.

Keys are vLLM's file names of the chunks (:class:`FileMapper`, as the ``fs``
and ``obj`` tiers name their files) under ``prefix``: the model, a digest of
the KV layout and the chunk's hash, equal on every engine that computes the
same chunk, so engines sharing a pool hit each other's prefixes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
import traceback
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.connector.store_access import StoreAccess
from kvpool.connector.tier_config import OffloadTierConfig
from kvpool.core.errors import ErrorCode

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KVPoolTier", "OffloadTierConfig", "TierStats"]

log = logging.getLogger("kvpool.connector.tier")

_MIB = 1 << 20
# A put answered "already exists" stored nothing, but the chunk is in the pool.
_STORED = frozenset({ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS})


# Counters exported through vLLM's offloading metrics (``get_stats``), per tier.
_METRICS = {
    "lookup_calls": "master calls the tier made to look chunks up (one per step at most)",
    "in_flight_answers": "chunks the master said were still being put (answered RETRY)",
    "stores_dropped": "store jobs the tier dropped at once: in-flight bounds reached, or the "
                      "pool marked down",
    "store_failures": "store jobs the pool failed, in whole or part",
    "load_failures": "load jobs the pool failed, in whole or part (the chunks are recomputed)",
}
_METRIC_PREFIX = "kvpool_offload_tier_"


@dataclass
class TierStats:
    """Counters of one tier since it started (read by tests, exported through
    vLLM's metrics: see ``_METRICS``)."""

    lookup_calls: int = 0  # batch_locate calls sent to the master
    keys_looked_up: int = 0
    hits: int = 0
    in_flight_answers: int = 0  # keys the master answered "put in flight" (RETRY)
    stores: int = 0
    stores_dropped: int = 0  # refused by backpressure or a pool marked down
    store_failures: int = 0
    bytes_stored: int = 0
    loads: int = 0
    load_failures: int = 0
    bytes_loaded: int = 0


@dataclass(slots=True)
class _Verdict:
    """What the pool said of one key, while requests ask about it."""

    gen: int  # the asking this answer must come from (older answers are ignored)
    since: float  # when first asked
    result: bool | None = None  # None: not known yet (RETRY)
    reqs: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Job:
    keys: list[OffloadKey]
    is_load: bool
    nbytes: int
    future: Future[None] | None = None


def _drop_frames(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (and
    its causes'): whoever keeps the exception keeps no buffer they named."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class KVPoolTier(SecondaryTierManager):
    """A vLLM secondary tier that keeps chunks in a kvpool pool (see the module
    docstring). Constructed by vLLM's ``SecondaryTierFactory`` with the keys
    of its ``secondary_tiers`` entry (:class:`OffloadTierConfig`)."""

    medium: ClassVar[Medium] = Medium.CPU
    # kvpool memory is another host's (or this host's shared) DRAM: not this
    # engine's own host cache, which HOST would claim.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: BackpressureDetector | None = None,
                 **settings: Any) -> None:
        """Raise :class:`~kvpool.core.config.ConfigError` for a bad setting.
        Connects to nothing: the pool is reached on the first lookup or job."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.cfg = OffloadTierConfig.from_tier_config(settings)
        self.locality = Locality(self.cfg.locality)
        self._row_bytes = self.block_size_bytes
        # The CPU tier's rows as uint8 arrays sharing its memory: row c is chunk slot c.
        self._rows = np.asarray(primary_kv_view).view(np.uint8).reshape(
            len(primary_kv_view), self._row_bytes)
        self._mapper = FileMapper.from_offloading_spec(
            self.cfg.prefix, offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True)
        self._access = StoreAccess(self.cfg.connector_config())
        self._replicate: Any = None
        if self.cfg.replica_num > 1:
            from kvpool.store import ReplicateConfig
            self._replicate = ReplicateConfig(replica_num=self.cfg.replica_num)
        self.stats = TierStats()
        self._reported = TierStats()  # what get_stats handed vLLM so far

        self._events: list[OffloadingEvent] | None = None
        if self.cfg.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning("kvpool tier: enable_kv_events is set but vLLM's KV cache events "
                            "are off; the tier emits none")

        # Scheduler-thread state. Workers only put into the two queues.
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobResult] = []  # refused at submit: reported next poll
        self._storing: dict[OffloadKey, int] = {}  # key -> its store jobs in flight
        self._store_jobs = 0
        self._store_bytes = 0
        self._verdicts: dict[OffloadKey, _Verdict] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._asking: list[tuple[OffloadKey, int]] = []  # sent at this step's end
        self._lookups_in_flight = 0
        self._gen = itertools.count()
        self._done: queue.SimpleQueue[tuple[int, list[bool], float]] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[
            tuple[list[OffloadKey], list[int], list[ErrorCode]]] = queue.SimpleQueue()

        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpool-tier-lookup")
        self._load_pool = ThreadPoolExecutor(self.cfg.load_threads,
                                             thread_name_prefix="kvpool-tier-load")
        self._store_pool = ThreadPoolExecutor(self.cfg.store_threads,
                                              thread_name_prefix="kvpool-tier-store")
        self._closed = False

    def key_name(self, key: OffloadKey) -> str:
        """The pool key of an offload key (the same on every engine computing it)."""
        return self._mapper.get_file_name(key)

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the pool holds the chunk, MISS when it does not (or cannot
        say in time), RETRY while the answer is awaited or the chunk's put is
        in flight. Never calls the pool: keys asked here are sent together at
        the step's end."""
        self._take_answers()
        if key in self._storing:
            return LookupResult.RETRY
        now = time.monotonic()
        req_id = req_context.req_id
        v = self._verdicts.get(key)
        if v is None:
            v = self._verdicts[key] = _Verdict(next(self._gen), now)
            self._asking.append((key, v.gen))
        elif v.result is False and req_id not in v.reqs and \
                now - v.since >= self.cfg.lookup_wait_s:
            # a miss kept alive by earlier requests may be stale (another engine
            # may have stored the chunk since): a new request asks again
            v.gen, v.since, v.result = next(self._gen), now, None
            self._asking.append((key, v.gen))
        v.reqs.add(req_id)
        self._req_keys.setdefault(req_id, set()).add(key)
        if v.result is None:
            if now - v.since < self.cfg.lookup_wait_s:
                return LookupResult.RETRY
            v.result = False  # the pool did not answer in time: serve without it
        return LookupResult.HIT if v.result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's new lookups as one master call (from the lookup
        thread); a pool marked down answers them all miss at once. While a
        call is still unanswered, new keys wait for the first step end after
        it (one call in flight: a slow master is not sent a queue of them)."""
        self._take_answers()
        if self._lookups_in_flight:
            return
        asking, self._asking = self._asking, []
        keys: list[OffloadKey] = []
        gens: list[int] = []
        for key, gen in asking:
            v = self._verdicts.get(key)
            if v is not None and v.gen == gen and v.result is None:
                keys.append(key)
                gens.append(gen)
        if not keys:
            return
        if self._access.is_down:
            for key in keys:
                self._verdicts[key].result = False
            return
        self._lookups_in_flight += 1
        self._lookup_pool.submit(self._lookup_task, keys, gens)

    def _lookup_task(self, keys: list[OffloadKey], gens: list[int]) -> None:
        """Lookup thread: one batch_locate; any failure answers every key miss."""
        try:
            names = [self.key_name(k) for k in keys]
            locs = self._access.call(lambda c: c.batch_locate(names))
            codes = [ErrorCode(loc.code) for loc in locs]
        except Exception as exc:  # the engine serves on without the pool
            log.debug("kvpool tier lookup of %d keys failed: %s", len(keys), exc)
            codes = [ErrorCode.RPC_FAIL] * len(keys)
        self._answers.put((keys, gens, codes))

    def _take_answers(self) -> None:
        """Apply the lookup thread's answers (scheduler thread)."""
        now = time.monotonic()
        while True:
            try:
                keys, gens, codes = self._answers.get_nowait()
            except queue.Empty:
                return
            self._lookups_in_flight -= 1
            self.stats.lookup_calls += 1
            self.stats.keys_looked_up += len(keys)
            for key, gen, code in zip(keys, gens, codes, strict=True):
                v = self._verdicts.get(key)
                if v is None or v.gen != gen:
                    continue  # its requests finished, or it was asked again since
                if code == ErrorCode.OK:
                    v.result = True
                    self.stats.hits += 1
                elif code == ErrorCode.REPLICA_IS_NOT_READY and \
                        now - v.since < self.cfg.lookup_wait_s:
                    # another engine's put of it has not ended: ask again next step
                    self.stats.in_flight_answers += 1
                    v.gen = next(self._gen)
                    self._asking.append((key, v.gen))
                else:
                    v.result = False

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading (vLLM's default)."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's lookups (answers still on their way are dropped)."""
        req_id = req_context.req_id
        for key in self._req_keys.pop(req_id, ()):
            v = self._verdicts.get(key)
            if v is None:
                continue
            v.reqs.discard(req_id)
            if not v.reqs:
                del self._verdicts[key]

    # ------------------------------------------------------------------ jobs

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Start storing the job's CPU-tier rows into the pool, or drop it at
        once (reported failed) when the pool is marked down or the bytes or
        jobs in flight are at their bounds."""
        keys = list(job_metadata.keys)
        nbytes = len(keys) * self._row_bytes
        if self._store_refused(nbytes):
            self.stats.stores_dropped += 1
            self._finished.append(JobResult(job_metadata.job_id, success=False))
            return
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        job = self._jobs[job_metadata.job_id] = _Job(keys, False, nbytes)
        for k in keys:
            self._storing[k] = self._storing.get(k, 0) + 1
        self._store_jobs += 1
        self._store_bytes += nbytes
        job.future = self._store_pool.submit(self._task, job_metadata.job_id,
                                             [self.key_name(k) for k in keys], rows, False)

    def _store_refused(self, nbytes: int) -> bool:
        if self._access.is_down:
            return True
        if self._store_jobs >= self.cfg.max_inflight_stores:
            return True
        # one job larger than the bound alone still goes, when nothing else moves
        limit = self.cfg.max_inflight_mib * _MIB
        return self._store_bytes > 0 and self._store_bytes + nbytes > limit

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Start reading the job's chunks from the pool into its CPU-tier rows."""
        keys = list(job_metadata.keys)
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        job = self._jobs[job_metadata.job_id] = _Job(keys, True, len(keys) * self._row_bytes)
        job.future = self._load_pool.submit(self._task, job_metadata.job_id,
                                            [self.key_name(k) for k in keys], rows, True)

    def _task(self, job_id: int, names: list[str], rows: list[np.ndarray], is_load: bool) -> None:
        """Store or load thread: one batch call; always reports the job. A
        loaded chunk counts only when exactly one row of bytes came (a shorter
        or longer object is a failed chunk)."""
        t0 = time.monotonic()
        try:
            if is_load:
                got = self._access.call(lambda c: c.batch_get_into(names, rows))
                ok = [n == self._row_bytes for n in got]
            else:
                codes = self._access.call(
                    lambda c: c.batch_put_from(names, rows, self._replicate))
                ok = [code in _STORED for code in codes]
        except Exception as exc:  # a failed load is recomputed, a failed store a later miss
            log.debug("kvpool tier %s of %d chunks failed: %s",
                      "load" if is_load else "store", len(names), exc)
            _drop_frames(exc)
            ok = [False] * len(names)
        finally:
            # a traceback a log handler keeps must not pin the CPU tier's
            # memory (vLLM closes its mmap at shutdown)
            rows.clear()
        self._done.put((job_id, ok, time.monotonic() - t0))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call. A load that failed for some of
        its chunks names the ones that loaded (``successful_keys``) and makes
        the others misses for the requests that asked (no retry livelock)."""
        self._take_answers()
        results, self._finished = self._finished, []
        while True:
            try:
                job_id, ok, elapsed = self._done.get_nowait()
            except queue.Empty:
                break
            job = self._jobs.pop(job_id)
            results.append(self._load_result(job_id, job, ok, elapsed) if job.is_load
                           else self._store_result(job_id, job, ok, elapsed))
        return results

    def _store_result(self, job_id: int, job: _Job, ok: list[bool], elapsed: float) -> JobResult:
        self._store_jobs -= 1
        self._store_bytes -= job.nbytes
        for k in job.keys:
            n = self._storing[k] - 1
            if n:
                self._storing[k] = n
            else:
                del self._storing[k]
        stored = [k for k, good in zip(job.keys, ok, strict=True) if good]
        for k in stored:  # the pool has it now, whatever a lookup said before
            v = self._verdicts.get(k)
            if v is not None:
                v.gen, v.result = next(self._gen), True
        self.stats.stores += 1
        self.stats.bytes_stored += len(stored) * self._row_bytes
        if self._events is not None and stored:
            self._events.append(OffloadingEvent(keys=stored, medium=self.medium,
                                                removed=False, locality=self.locality))
        success = len(stored) == len(job.keys)
        if not success:
            self.stats.store_failures += 1
            return JobResult(job_id, success=False)
        return JobResult(job_id, success=True, transfer_time=elapsed, transfer_bytes=job.nbytes)

    def _load_result(self, job_id: int, job: _Job, ok: list[bool], elapsed: float) -> JobResult:
        loaded = [k for k, good in zip(job.keys, ok, strict=True) if good]
        self.stats.loads += 1
        self.stats.bytes_loaded += len(loaded) * self._row_bytes
        if len(loaded) == len(job.keys):
            return JobResult(job_id, success=True, transfer_time=elapsed,
                             transfer_bytes=job.nbytes)
        self.stats.load_failures += 1
        for k, good in zip(job.keys, ok, strict=True):
            v = self._verdicts.get(k)
            if not good and v is not None:
                v.result = False
        return JobResult(job_id, success=False, successful_keys=tuple(loaded) or None,
                         transfer_time=elapsed,
                         transfer_bytes=len(loaded) * self._row_bytes or None)

    def has_pending_work(self) -> bool:
        """True while jobs or lookups are in flight (their results need steps)."""
        return bool(self._jobs or self._finished or self._lookups_in_flight or self._asking)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored-chunk events (``enable_kv_events``), each once."""
        if self._events:
            events, self._events = self._events, []
            yield from events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing to do: the master moves a chunk to the recent end of its LRU
        whenever a lookup or read locates it."""
        return

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The tier's counters, labelled by tier type, as vLLM registers them."""
        return {_METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=doc,
                                                                 labelnames=("tier",))
                for name, doc in _METRICS.items()}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The counters' increases since the last call (None: no change)."""
        stats = OffloadingConnectorStats()
        for name in _METRICS:
            delta = getattr(self.stats, name) - getattr(self._reported, name)
            if delta:
                stats.increase_counter(_METRIC_PREFIX + name, delta, (self.tier_type,))
                setattr(self._reported, name, getattr(self.stats, name))
        return None if stats.is_empty() else stats

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (each is bounded by the
        client's RPC and transfer timeouts); results stay for the next poll."""
        futures = [j.future for j in self._jobs.values() if j.future is not None]
        if futures:
            wait(futures)

    def shutdown(self) -> None:
        """Finish the jobs in flight, stop the threads, close the client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.drain_jobs()
        for pool in (self._lookup_pool, self._load_pool, self._store_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        self._access.close()
        # vLLM closes the CPU tier's mmap next: no view of it may be left
        self._rows = np.empty((0, self._row_bytes), np.uint8)
