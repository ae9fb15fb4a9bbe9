"""Load-or-recompute decisions (pure) and the scheduler using them with real
replica locations from a master (no vLLM)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.estimate import ChunkCost, DecisionKind, SpeedBook, decide, peer_key
from kvpool.connector.keys import KeySpace
from kvpool.connector.metadata import WorkerReport
from kvpool.connector.scheduler import KVPoolScheduler, StepInfo
from kvpool.connector.store_access import StoreAccess

MiB = 1 << 20
FAST, SLOW = "mem:local:a", "mem:net:b"


def _book(tps: float | None = 10_000.0, **bw: float) -> SpeedBook:
    b = SpeedBook(reprobe_s=30.0)
    if tps:
        b.observe_prefill(1000, 1000 / tps)
    for peer, rate in bw.items():
        b.observe_load(peer.replace("_", ":"), 8 * MiB, 8 * MiB / rate)
    return b


def test_unmeasured_peer_is_probed_within_a_fraction_of_recompute() -> None:
    costs = [ChunkCost(FAST, 4 * MiB, 256)] * 16  # 4096 tokens: 4.096 s to recompute
    d = decide(_book(tps=1000), costs, load_timeout_s=2.0, probe_fraction=0.25)
    assert d.kind is DecisionKind.PROBE and d.chunks == 16
    assert d.deadline_s == pytest.approx(0.25 * 4.096)
    assert decide(_book(), costs[:1], 2.0).deadline_s == 0.25  # the floor
    d = decide(_book(tps=None), costs, load_timeout_s=2.0)  # no prefill measured: the timeout
    assert d.kind is DecisionKind.PROBE and d.deadline_s == 2.0


def test_fast_peer_loads_slow_peer_recomputes_mixed_loads_the_fast_part() -> None:
    book = _book(**{"mem_local_a": 4e9, "mem_net_b": 2e6})  # 4 GB/s vs a 16 Mbit/s link
    fast = [ChunkCost(FAST, 4 * MiB, 256)] * 4
    d = decide(book, fast, 2.0)
    assert d.kind is DecisionKind.LOAD and d.chunks == 4
    assert d.predicted_load_s == pytest.approx(16 * MiB / 4e9)
    assert d.predicted_recompute_s == pytest.approx(0.1024)
    assert d.predicted_load_s < d.deadline_s == 0.25  # 2x the load time is below the floor
    d = decide(book, [ChunkCost(SLOW, 4 * MiB, 256)] * 4, 2.0)
    assert d.kind is DecisionKind.RECOMPUTE and d.chunks == 0
    d = decide(book, fast[:2] + [ChunkCost(SLOW, 4 * MiB, 256)] * 2, 2.0)
    assert d.kind is DecisionKind.PARTIAL and d.chunks == 2


def test_failed_peer_is_avoided_then_probed_again() -> None:
    book = _book(**{"mem_local_a": 4e9})
    book.reprobe_s = 0.2
    book.observe_failure(FAST)
    costs = [ChunkCost(FAST, 4 * MiB, 256)] * 2
    assert decide(book, costs, 2.0).kind is DecisionKind.AVOID
    time.sleep(0.25)
    assert decide(book, costs, 2.0).kind is DecisionKind.PROBE  # measurement dropped too
    book.observe_load(FAST, 8 * MiB, 0.002)
    assert decide(book, costs, 2.0).kind is DecisionKind.LOAD
    time.sleep(0.25)  # a measurement older than reprobe_s is probed again
    assert decide(book, costs, 2.0).kind is DecisionKind.PROBE


def test_peer_keys() -> None:
    assert peer_key(0, True, "h1") == "mem:local:h1"
    assert peer_key(1, False, "h2") == "disk:net:h2"


@pytest.fixture(scope="module")
def pools() -> Iterator[tuple[str, str]]:
    """Two pools: one whose daemon is on this host, one whose daemon says it is not."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m1, NodeDaemonProcess(m1.address, memory="8MiB"), \
            MasterProcess() as m2, NodeDaemonProcess(m2.address, memory="8MiB",
                                                     host_id="far-host"):
        yield m1.address, m2.address


def _sched_with_chunks(address: str, toks: list[int]) -> tuple[KVPoolScheduler, KeySpace]:
    from kvpool.store import Client, ClientConfig

    ks = KeySpace("est", "bf16", 16, 32)
    with Client(ClientConfig(master_address=address)) as c:
        for h in ks.chunk_hashes(toks):
            for k in ks.chunk_keys(h, 2, 4):
                c.put(k, b"k" * (64 << 10))
    cfg = ConnectorConfig(master_address=address, chunk_size=32)
    return KVPoolScheduler(cfg, ks, 2, StoreAccess(cfg)), ks


def test_scheduler_decides_from_replica_locations(pools: tuple[str, str]) -> None:
    near, far = pools
    toks = list(range(3000, 3097))  # 3 full chunks + 1 token
    s_near, _ = _sched_with_chunks(near, toks)
    s_far, _ = _sched_with_chunks(far, toks)
    # fresh: both probe (loads everything, bounded)
    assert s_near.lookup("r", toks, 0) == (96, False)
    assert s_near._lookups["r"].peers == [peer_key(0, True, s_near.store.client().host_id)] * 3
    assert s_far.lookup("r", toks, 0) == (96, False)
    far_peer = "mem:net:far-host"
    assert s_far._lookups["r"].peers == [far_peer] * 3
    # measured: this engine prefills 2k tokens/s; the far peer moves 100 KB/s
    for s, peer, rate in ((s_near, s_near._lookups["r"].peers[0], 1e9),
                          (s_far, far_peer, 1e5)):
        s.observe(WorkerReport(loads=[(peer, 1 << 20, (1 << 20) / rate)],
                               forwards=[(2000, 1.0)]))
    assert s_near.lookup("q", toks, 0) == (96, False)  # 0.2 ms to load vs 48 ms to compute
    assert s_far.lookup("q", toks, 0) == (0, False)  # 2 s to load vs 48 ms to compute
    s_far.after_alloc("q", None, toks, [[1, 2, 3, 4, 5, 6, 7]], 0)
    s_near.after_alloc("q", None, toks, [[1, 2, 3, 4, 5, 6, 7]], 96)
    assert s_far.stats.totals()["decisions_recompute"] == 1
    tot = s_near.stats.totals()
    assert tot["decisions_load"] == 1 and tot["predicted_load_s"] > 0
    (load,) = s_near.build_meta(StepInfo()).loads
    assert load.deadline_s == 0.25 and load.predicted_s is not None
    for s in (s_near, s_far):
        s.store.close()
