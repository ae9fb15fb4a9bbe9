"""A vLLM scheduler's native-offloading manager with the kvpool tier, for tests
and benchmarks (vLLM is imported when an :class:`Engine` is made).

:class:`Engine` builds vLLM's own ``TieringOffloadingSpec`` (the real CPU
tier in shared memory) with :class:`kvpool.connector.offload_tier.KVPoolTier`
loaded by ``module_path``, and drives its manager the way vLLM's offloading
scheduler does; the GPU side of the CPU tier is played by writing and
reading its rows.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Engine"]

_engines = itertools.count()


class Engine:
    """One vLLM scheduler's offloading manager (real spec, real CPU tier)."""

    def __init__(self, master: str, events: bool = False, row: int = 16384, chunks: int = 16,
                 step_s: float = 0.01, **tier: Any) -> None:
        """An engine whose CPU tier has ``chunks`` rows of ``row`` bytes
        (page-aligned, as vLLM requires), stepping every ``step_s`` while it
        waits; ``tier``: the tier's settings. ``sched_s`` / ``max_call_s``:
        the time its scheduler thread spent in the manager's calls, in all and
        in the longest one (what a step of vLLM would wait for)."""
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        entry = {"type": "KVPoolTier", "module_path": "kvpool.connector.offload_tier",
                 "master_address": master, "rpc_timeout_s": 1.0, **tier}
        config = OffloadingConfig(
            groups=(), worker_kv_bytes_per_block=row, enable_kv_cache_events=events,
            extra_config={"cpu_bytes_to_use": chunks * row, "secondary_tiers": [entry]},
            engine_id=f"kvpool-tier-test-{os.getpid()}-{next(_engines)}",
            model=OffloadingModelConfig(name="org/tiny-model", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False))
        manager: Any = TieringOffloadingSpec(config).get_manager()
        self.manager = manager
        self.tier: Any = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.step_s = step_s
        self.sched_s = 0.0
        self.max_call_s = 0.0

    def _timed(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.sched_s += dt
        self.max_call_s = max(self.max_call_s, dt)

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        t0 = time.perf_counter()
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        self._timed(t0)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Step until no transfer or lookup is in flight."""
        deadline = time.monotonic() + timeout_s
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            self.step()
            time.sleep(self.step_s)
        self.step()

    def store(self, req: str, keys: list[bytes], data: list[np.ndarray]) -> None:
        """What the offloading scheduler and worker do for a request's computed
        chunks: the CPU tier takes them, then cascades them to the pool."""
        self.complete_store(self.prepare_store(req, keys, data), keys)

    def prepare_store(self, req: str, keys: list[bytes], data: list[np.ndarray]) -> Any:
        """A new request's chunks stored into the CPU tier (prepare, then the
        GPU -> CPU copy); its context, for :meth:`complete_store`."""
        ctx = self.ctx(req)
        t0 = time.perf_counter()
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        self._timed(t0)
        assert out is not None and list(out.keys_to_store) == keys
        for cid, value in zip(out.store_spec.chunk_ids, data, strict=True):
            self.rows[int(cid)] = value  # the GPU -> CPU copy
        return ctx

    def complete_store(self, ctx: Any, keys: list[bytes]) -> None:
        """The copy is done: vLLM cascades the chunks to the pool; the request ends."""
        t0 = time.perf_counter()
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self._timed(t0)

    def lookup(self, ctx: Any, keys: list[bytes], timeout_s: float = 10.0,
               until: Callable[[list[Any]], bool] | None = None) -> list[Any]:
        """Look the keys up step after step (as the scheduler does for a waiting
        request) until no answer is RETRY/HIT_PENDING (or ``until`` holds)."""
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.monotonic() + timeout_s
        while True:
            t0 = time.perf_counter()
            res = [self.manager.lookup(k, ctx) for k in keys]
            self._timed(t0)
            done = until(res) if until is not None else not any(
                r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for r in res)
            if done:
                return res
            assert time.monotonic() < deadline, f"lookups still pending: {res}"
            self.step()
            time.sleep(self.step_s)

    def read(self, ctx: Any, keys: list[bytes]) -> list[bytes]:
        """Prepare a load of HIT keys and return their CPU-tier rows (the CPU
        -> GPU copy), then complete it."""
        spec = self.manager.prepare_load(keys, ctx)
        out = [self.rows[int(c)].tobytes() for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return out

    @staticmethod
    def ctx(req: str) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        return ReqContext(req_id=req)

    def close(self) -> None:
        del self.rows  # (vLLM closes the region's mmap: no view of it may be left)
        self.manager.shutdown()
