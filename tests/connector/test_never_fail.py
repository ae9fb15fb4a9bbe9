"""A slow, frozen or emptied pool never fails a request: loads end by their
deadline and report the blocks they could not deliver, the scheduler never
offers that request a load again, and nothing waits on the store past the
deadline. Real master and node daemon processes; the daemon registers as
another host, so reads go over TCP to its transfer server (a same-host reader
would map its shared memory and not need the process). Needs torch."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec, SaveSpec
from kvpool.connector.scheduler import KVPoolScheduler, NewReq, StepInfo
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import KVPoolWorker
from support.vllm_engine import drive_step

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch not importable (the vllm extra)"),
    pytest.mark.timeout(120),
]

NB, HEADS, BLOCK, HEAD, LAYERS = 16, 2, 32, 32, 3
KS = KeySpace("nf", "bfloat16", BLOCK, 2 * BLOCK)


@pytest.fixture(scope="module")
def far_pool() -> Iterator[tuple[str, Any]]:
    """A master and a node daemon that says it is on another host."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="32MiB",
                                                 host_id="far-host") as d:
        yield m.address, d


def _caches(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, NB, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
    return {f"model.layers.{i}.attn": buf[i] for i in range(LAYERS)}


def _worker(address: str, caches: dict[str, Any], **kw: Any) -> KVPoolWorker:
    cfg = ConnectorConfig(master_address=address, chunk_size=KS.chunk_size, **kw)
    w = KVPoolWorker(cfg, KS, StoreAccess(cfg))
    w.register_kv_caches(caches)
    return w


def _stored(address: str, seed: int, n: int = 2) -> tuple[list[ChunkRef], dict[str, Any]]:
    src = _caches(seed)
    w = _worker(address, src)
    toks = [seed] * (KS.chunk_size * n)
    chunks = [ChunkRef(i, h, [2 * i, 2 * i + 1]) for i, h in enumerate(KS.chunk_hashes(toks))]
    assert w.save([SaveSpec("writer", chunks)]) == n
    w.close()
    w.store.close()
    return chunks, src


def _into(chunks: list[ChunkRef], first_block: int) -> list[ChunkRef]:
    return [ChunkRef(c.index, c.hash, [first_block + 2 * i, first_block + 2 * i + 1])
            for i, c in enumerate(chunks)]


def test_frozen_peer_load_ends_at_its_deadline(far_pool: tuple[str, Any],
                                               caplog: pytest.LogCaptureFixture) -> None:
    address, daemon = far_pool
    chunks, src = _stored(address, seed=11)
    dst = _caches(12)
    w = _worker(address, dst, load_timeout_s=0.5)
    warm = w.load(LoadSpec("warm", _into(chunks, 8)), timeout_s=20)  # connects to the peer
    assert warm.failed_block_ids == set()
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="kvpool.connector"):
            for req in ("a", "b"):  # the second finds the first's buffer still taken
                t0 = time.monotonic()
                failed = drive_step(w, ConnectorMeta(loads=[LoadSpec(req, _into(chunks, 4))]))
                took = time.monotonic() - t0
                assert took < 0.5 + 1.0, took  # the deadline, not the store's 30 s timeout
                assert failed == {4, 5, 6, 7}
        assert any("recomputed" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # Thawed: the same worker loads again, bytes equal.
    res = w.load(LoadSpec("c", _into(chunks, 10)), timeout_s=20)
    assert res.failed_block_ids == set() and res.loaded_chunks == 2
    for name in src:
        assert dst[name][10:14].equal(src[name][0:4])
    w.close()
    w.store.close()


def test_evicted_between_lookup_and_load_is_recomputed_once(far_pool: tuple[str, Any]) -> None:
    """The lookup finds both chunks, chunk 1 is removed before the load: its
    blocks come back as failed, chunk 0 lands, and the scheduler never offers
    that request a load again."""
    address, _daemon = far_pool
    chunks, src = _stored(address, seed=21)
    cfg = ConnectorConfig(master_address=address, chunk_size=KS.chunk_size)
    store = StoreAccess(cfg)
    sched = KVPoolScheduler(cfg, KS, LAYERS, store)
    toks = [21] * (KS.chunk_size * 2) + [5]
    assert sched.lookup("r", toks, 0) == (128, False)
    blocks = [8, 9, 10, 11, 12]
    sched.after_alloc("r", None, toks, [blocks], 128)
    meta = sched.build_meta(StepInfo(new=[NewReq("r", [blocks], 128)],
                                     num_scheduled_tokens={"r": 1}))
    store.call(lambda c: c.remove(KS.chunk_keys(chunks[1].hash, LAYERS, 4)[-1], force=True))
    dst = _caches(22)
    w = _worker(address, dst)
    failed = drive_step(w, meta)
    assert failed == {10, 11}
    for name in src:
        assert dst[name][8:10].equal(src[name][0:2])
    assert sched.loads_failed(failed) == {"r"}
    assert sched.lookup("r", toks, 0) == (0, False)  # computed, never loaded again
    assert sched.lookup("other", toks, 0) == (64, False)  # chunk 0 is still a hit for others
    w.close()
    w.store.close()
    store.close()
