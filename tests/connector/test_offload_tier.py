"""kvpool as a secondary tier of vLLM's native offloading, driven by vLLM's own
classes: ``TieringOffloadingSpec`` builds the real CPU primary tier (its
shared-memory region) and loads :class:`KVPoolTier` by ``module_path`` from
the ``secondary_tiers`` config, and ``TieringOffloadingManager`` drives it the
way vLLM's offloading scheduler does (prepare/complete store, lookup, step
ends). The GPU side of the CPU tier is played by writing and reading its rows.
A real master and node daemon hold the pool."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from support.offload_tier import Engine

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm not importable: install the vllm extra (scripts/install_vllm.sh)",
)
pytestmark = [pytest.mark.vllm, needs_vllm, pytest.mark.timeout(60)]

ROW = 16384  # bytes of one CPU-tier chunk row (page-aligned, as vLLM requires)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="32MiB"):
        yield m


@pytest.fixture
def own_pool() -> Iterator[Any]:
    """A pool this test alone may stop and resume."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="16MiB"):
        yield m


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(master: str, **kw: Any) -> Engine:
        e = Engine(master, row=ROW, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _keys(n: int, salt: str) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"{salt}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


def _data(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, ROW, dtype=np.uint8) for _ in range(n)]


def test_two_engines_share_chunks_through_the_pool(pool: Any, engines: Any) -> None:
    from vllm.v1.kv_offload.base import Locality, LookupResult, Medium

    from kvpool.store import Client, ClientConfig

    a = engines(pool.address, events=True, enable_kv_events=True, prefix="t-share",
                backpressure={"backpressure_cls": "EMABackpressureDetector",
                              "warmup_completions": 1})
    b = engines(pool.address, prefix="t-share")
    ka, da = _keys(3, "a"), _data(3, 1)
    kb, db = _keys(2, "b"), _data(2, 2)

    # Each engine computes different chunks; vLLM cascades them to the pool.
    a.store("a-0", ka, da)
    b.store("b-0", kb, db)
    a.settle()
    b.settle()
    assert a.tier.stats.stores == 1 and a.tier.stats.bytes_stored == 3 * ROW
    # vLLM's backpressure detector (built by its factory) saw the store's latency
    assert a.tier.bp_detector is not None and a.tier.bp_detector.store_latency_ema > 0
    assert b.tier.stats.stores == 1 and b.tier.stats.store_failures == 0
    # The pool keys are vLLM's chunk file names: the same on both engines.
    assert a.tier.key_name(ka[0]) == b.tier.key_name(ka[0])
    assert a.tier.key_name(ka[0]).startswith("t-share/org_tiny-model_")
    with Client(ClientConfig(master_address=pool.address)) as c:
        names = [a.tier.key_name(k) for k in ka + kb]
        assert c.batch_exists(names) == [True] * 5
        assert [c.get_size(n) for n in names] == [ROW] * 5
    events = [e for e in a.manager.take_events() if e.locality is Locality.REMOTE]
    assert [list(e.keys) for e in events] == [ka] and events[0].medium is Medium.CPU
    assert not events[0].removed

    # b needs a's prefix plus its own chunks: its own are HITs in its CPU tier;
    # a's come from the pool (RETRY while asked, HIT_PENDING while promoted).
    ctx = b.ctx("b-1")
    b.manager.on_new_request(ctx)
    first = [b.manager.lookup(k, ctx) for k in ka + kb]
    assert first == [LookupResult.RETRY] * 3 + [LookupResult.HIT] * 2
    assert b.tier.stats.lookup_calls == 0  # nothing sent before the step ends
    res = b.lookup(ctx, ka + kb)
    assert res == [LookupResult.HIT] * 5
    assert b.tier.stats.lookup_calls == 1 and b.tier.stats.keys_looked_up == 3
    assert b.tier.stats.loads == 1 and b.tier.stats.bytes_loaded == 3 * ROW
    assert b.read(ctx, ka + kb) == [d.tobytes() for d in da + db]
    b.manager.on_request_finished(ctx)

    # Two requests of a asking in the same step: one master call for both.
    r1, r2 = a.ctx("a-1"), a.ctx("a-2")
    for r in (r1, r2):
        a.manager.on_new_request(r)
    assert [a.manager.lookup(k, r1) for k in kb[:1]] == [LookupResult.RETRY]
    assert [a.manager.lookup(k, r2) for k in kb] == [LookupResult.RETRY] * 2
    a.step()
    assert a.lookup(r1, kb[:1]) == [LookupResult.HIT]
    assert a.lookup(r2, kb) == [LookupResult.HIT] * 2
    assert a.tier.stats.lookup_calls == 1 and a.tier.stats.keys_looked_up == 2
    assert a.read(r2, kb) == [d.tobytes() for d in db]
    for r in (r1, r2):
        a.manager.on_request_finished(r)

    # A chunk nobody stored is a miss after one step.
    ctx = a.ctx("a-3")
    a.manager.on_new_request(ctx)
    assert a.lookup(ctx, _keys(1, "none")) == [LookupResult.MISS]
    a.manager.on_request_finished(ctx)

    # vLLM's reset_cache (sleep, weight update) drains the stores in flight.
    stores = a.tier.stats.stores
    a.store("a-4", _keys(2, "reset"), _data(2, 5))
    a.manager.reset_cache()
    assert a.tier.stats.stores == stores + 1 and not a.manager.has_pending_work()


def test_in_flight_chunks_answer_retry_and_bad_sizes_never_load(
        pool: Any, engines: Any) -> None:
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvpool.store.client import Client, ClientConfig, RangeWrite

    e = engines(pool.address, prefix="t-retry", lookup_wait_s=0.5)
    tier = e.tier
    ctx = e.ctx("r-0")
    e.manager.on_new_request(ctx)

    # 1. This tier's own store in flight: RETRY until its job is reported.
    k_own = _keys(1, "own")
    tier.submit_store(TransferJob(job_id=10_000, keys=k_own, chunk_ids=np.array([3]),
                                  is_promotion=False, req_context=ctx))
    assert tier.lookup(k_own[0], ctx) is LookupResult.RETRY
    tier.drain_jobs()
    [done] = list(tier.get_finished_jobs())
    assert done.job_id == 10_000 and done.success

    k_other, k_stuck, k_short = _keys(3, "other")
    [want] = _data(1, 3)
    with Client(ClientConfig(master_address=pool.address)) as c:
        # 2. Another engine's put granted but not ended: RETRY, then a HIT with
        # its bytes once it ends.
        other, stuck = tier.key_name(k_other), tier.key_name(k_stuck)
        g_other, g_stuck = c.batch_put_reserve([other, stuck], [ROW, ROW])
        assert g_other.code == 0 and g_stuck.code == 0
        assert e.lookup(ctx, [k_other], timeout_s=0.3,
                        until=lambda r: tier.stats.lookup_calls >= 2) == [LookupResult.RETRY]
        assert tier.stats.in_flight_answers >= 1
        [(ok, err)] = c.write_ranges([RangeWrite(want, g_other.replicas, caps=g_other.caps)])
        assert ok, err
        assert c.batch_put_commit([other]) == [0]
        assert e.lookup(ctx, [k_other]) == [LookupResult.HIT]
        assert e.read(ctx, [k_other]) == [want.tobytes()]

        # 3. A put that never ends: RETRY for at most lookup_wait_s, then a miss.
        t0 = time.monotonic()
        assert e.lookup(ctx, [k_stuck]) == [LookupResult.MISS]
        assert time.monotonic() - t0 < 3.0
        c.batch_put_abort([stuck])

        # 4. An object under a chunk's key whose size is not one row: found,
        # but the load fails and the chunk is a miss; no row is handed out.
        c.put(tier.key_name(k_short), b"x" * (ROW // 2))
        failures = tier.stats.load_failures
        assert e.lookup(ctx, [k_short]) == [LookupResult.MISS]
        assert tier.stats.load_failures == failures + 1

        # 5. A miss kept alive by a running request is asked again for a new
        # request once it is lookup_wait_s old: a chunk stored since is a hit.
        [k_late] = _keys(1, "late")
        assert e.lookup(ctx, [k_late]) == [LookupResult.MISS]
        [late] = _data(1, 4)
        c.put(tier.key_name(k_late), late.tobytes())
        assert e.lookup(ctx, [k_late]) == [LookupResult.MISS]  # (the same request)
        time.sleep(0.5)
        ctx2 = e.ctx("r-1")
        e.manager.on_new_request(ctx2)
        assert e.lookup(ctx2, [k_late]) == [LookupResult.HIT]
        assert e.read(ctx2, [k_late]) == [late.tobytes()]
        e.manager.on_request_finished(ctx2)

    # 6. A miss the tier then stores itself is a hit at once, for the same request.
    [k_mine] = _keys(1, "mine")
    assert tier.lookup(k_mine, ctx) is LookupResult.RETRY
    e.step()
    assert e.lookup(ctx, [k_mine]) == [LookupResult.MISS]
    tier.submit_store(TransferJob(job_id=10_001, keys=[k_mine], chunk_ids=np.array([3]),
                                  is_promotion=False, req_context=ctx))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert tier.lookup(k_mine, ctx) is LookupResult.HIT
    e.manager.on_request_finished(ctx)


def test_slow_or_dead_pool_gives_backpressure_and_misses(own_pool: Any, engines: Any) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    e = engines(own_pool.address, prefix="t-dead", max_inflight_stores=1, rpc_timeout_s=0.5,
                retry_interval_s=30.0)
    fresh = engines(own_pool.address, prefix="t-dead", rpc_timeout_s=0.5, retry_interval_s=30.0)
    k_ok, k_late = _keys(1, "ok"), _keys(2, "late")
    e.store("d-0", k_ok, _data(1, 4))
    e.settle()
    assert e.tier.stats.stores == 1 and e.tier.stats.store_failures == 0

    os.kill(own_pool.pid, signal.SIGSTOP)  # the master stops answering
    try:
        t0 = time.monotonic()
        # Two stores in one step with room for one in flight: the second is
        # dropped at once, the first fails at the RPC timeout; neither blocks.
        e.store("d-1", k_late[:1], _data(1, 5))
        e.store("d-2", k_late[1:], _data(1, 6))
        assert time.monotonic() - t0 < 0.3
        assert e.tier.stats.stores_dropped == 1
        e.settle()
        assert e.tier.stats.store_failures == 1

        # A chunk that is in the pool, asked of a dead master: a miss within
        # the RPC timeout, never a hang; no load is attempted. Keys asked
        # while that call hangs are not sent after it: one call in flight.
        ctx = fresh.ctx("d-3")
        fresh.manager.on_new_request(ctx)
        t0 = time.monotonic()
        assert fresh.manager.lookup(k_ok[0], ctx) is LookupResult.RETRY
        fresh.step()  # sent; the master does not answer
        more = _keys(2, "more")
        assert [fresh.manager.lookup(k, ctx) for k in more] == [LookupResult.RETRY] * 2
        assert fresh.lookup(ctx, k_ok + more) == [LookupResult.MISS] * 3
        assert time.monotonic() - t0 < 3.0
        assert fresh.tier.stats.lookup_calls == 1 and fresh.tier.stats.keys_looked_up == 1
        assert fresh.tier.stats.loads == 0
        fresh.manager.on_request_finished(ctx)

        # Once marked down, the tier answers without trying the pool.
        ctx = e.ctx("d-4")
        e.manager.on_new_request(ctx)
        t0 = time.monotonic()
        assert e.lookup(ctx, _keys(2, "never")) == [LookupResult.MISS] * 2
        assert time.monotonic() - t0 < 0.5
        e.store("d-5", _keys(1, "later"), _data(1, 7))
        assert e.tier.stats.stores_dropped == 2
        e.manager.on_request_finished(ctx)
    finally:
        os.kill(own_pool.pid, signal.SIGCONT)
    e.settle()

    # The tier's counters reach vLLM's offloading metrics, each increase once.
    stats = e.manager.get_stats()
    assert stats is not None
    data = stats.data["data"]
    assert data["kvpool_offload_tier_stores_dropped"] == {("KVPoolTier",): 2}
    assert data["kvpool_offload_tier_store_failures"] == {("KVPoolTier",): 1}
    again = e.manager.get_stats()
    assert again is None or "kvpool_offload_tier_stores_dropped" not in again.data["data"]


def test_metrics_and_bad_settings(pool: Any) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvpool.core.config import ConfigError

    # vLLM registers the tier's metrics from its config entry alone
    metrics = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [
        {"type": "KVPoolTier", "module_path": "kvpool.connector.offload_tier"}]})
    assert metrics["kvpool_offload_tier_lookup_calls"].labelnames == ("tier",)

    with pytest.raises(ConfigError, match="unknown config key"):
        Engine(pool.address, no_such_key=1)
    with pytest.raises(ConfigError, match="locality"):
        Engine(pool.address, locality="NEARBY")
