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
                 **tier: Any) -> None:
        """An engine whose CPU tier has ``chunks`` rows of ``row`` bytes
        (page-aligned, as vLLM requires); ``tier``: the tier's settings."""
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

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout_s: float = 10.0) -> None:
        """Step until no transfer or lookup is in flight."""
        deadline = time.monotonic() + timeout_s
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            self.step()
            time.sleep(0.01)
        self.step()

    def store(self, req: str, keys: list[bytes], data: list[np.ndarray]) -> None:
        """What the offloading scheduler and worker do for a request's computed
        chunks: the CPU tier takes them, then cascades them to the pool."""
        ctx = self.ctx(req)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for cid, value in zip(out.store_spec.chunk_ids, data, strict=True):
            self.rows[int(cid)] = value  # the GPU -> CPU copy
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)

    def lookup(self, ctx: Any, keys: list[bytes], timeout_s: float = 10.0,
               until: Callable[[list[Any]], bool] | None = None) -> list[Any]:
        """Look the keys up step after step (as the scheduler does for a waiting
        request) until no answer is RETRY/HIT_PENDING (or ``until`` holds)."""
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.monotonic() + timeout_s
        while True:
            res = [self.manager.lookup(k, ctx) for k in keys]
            done = until(res) if until is not None else not any(
                r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for r in res)
            if done:
                return res
            assert time.monotonic() < deadline, f"lookups still pending: {res}"
            self.step()
            time.sleep(0.01)

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
