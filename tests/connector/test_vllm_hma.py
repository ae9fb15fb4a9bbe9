"""The connector under vLLM's own scheduler and hybrid KV-cache manager (no
model runs): a sliding-window and a full-attention KV-cache group, a real
kvpool master and node daemon. Stores per group, hits that need only the
window's chunks, ``request_finished_all_groups``, a Mamba state group
(stored with prefix caching's "align" mode) and the pool turning off for
one it cannot store (Mamba without prefix caching)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm not importable: install the vllm extra"),
    pytest.mark.timeout(120),
]

BLOCK, CHUNK, WINDOW, BLOCKS = 32, 64, 64, 64
SW_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
FULL_LAYERS = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="16MiB"):
        yield m.address


def _vllm_config(model: str, master: str) -> Any:
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    ktc = KVTransferConfig(
        kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connector.vllm",
        kv_role="kv_both", kv_connector_extra_config={
            "master_address": master, "chunk_size": CHUNK, "load_or_recompute": False})
    vc = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=2048, seed=0),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8,
                                         max_model_len=2048, is_encoder_decoder=False),
        kv_transfer_config=ktc)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False  # SupportsHMA
    vc.cache_config.num_gpu_blocks = BLOCKS
    return vc


def _attention_groups() -> list[Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    kw: dict[str, Any] = dict(block_size=BLOCK, num_kv_heads=4, head_size=32,
                              dtype=torch.bfloat16)
    return [KVCacheGroupSpec(SW_LAYERS, SlidingWindowSpec(sliding_window=WINDOW, **kw)),
            KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**kw))]


def _scheduler(model: str, master: str) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    vc = _vllm_config(model, master)
    kcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=_attention_groups())
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BLOCK, log_stats=True)


def _request(req_id: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None)


def _hit(model: str, master: str, tokens: list[int], req_id: str) -> tuple[int, list[Any]]:
    """A fresh engine's scheduler: (kvpool hit tokens, its load plan)."""
    s = _scheduler(model, master)
    s.add_request(_request(req_id, tokens))
    meta = s.schedule().kv_connector_metadata
    return s.connector.stats.totals().get("hit_tokens", 0), meta.loads


def test_hybrid_groups_store_apart_and_hits_need_only_the_window(
        tiny_sliding_model: str, master: str) -> None:
    from vllm.v1.request import RequestStatus

    from kvpool.store import Client, ClientConfig

    toks = list(range(3, 203))  # 200 tokens: 3 full chunks, a hit covers 192
    s1 = _scheduler(tiny_sliding_model, master)
    conn = s1.connector
    assert [(g.num_layers, g.window) for g in conn.cache_groups] == [(2, WINDOW), (2, None)]
    req = _request("a", toks)
    s1.add_request(req)
    out = s1.schedule()
    sw_ids, full_ids = out.scheduled_new_reqs[0].block_ids
    (save,) = out.kv_connector_metadata.saves
    # every chunk's blocks of both groups, group after group
    assert [c.block_ids for c in save.chunks] == [
        [*sw_ids[2 * i : 2 * i + 2], *full_ids[2 * i : 2 * i + 2]] for i in range(3)]
    # vLLM's hybrid path calls request_finished_all_groups: the saves hold the blocks
    s1.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" in s1.requests

    # What the workers store: every chunk of the full group, the sliding group's
    # chunks 1 and 2 (chunk 0 had left the window; nothing needs it).
    sched = conn._sched
    h = [c.hash for c in save.chunks]
    key = sched._keys(h[0], 1, 1)[0]
    assert key == f"{conn.keys.prefix}/g1of2/l0-1/h0-4of4/{h[0]}"
    full = [k for x in h for k in sched._keys(x, 1, 1)]
    window = {i: sched._keys(h[i], 1, 0) for i in (1, 2)}
    with Client(ClientConfig(master_address=master)) as c:
        c.remove_all(force=True)
        for k in full + window[1] + window[2]:
            c.put(k, b"x" * 64)

        # A hit of 192 tokens needs the sliding group's chunk 2 only (its
        # window: tokens 129..191); vLLM gives that group null blocks before.
        hit, loads = _hit(tiny_sliding_model, master, toks, "b")
        assert hit == 192
        (load,) = loads
        assert load.is_async  # several groups: a failed load is recomputed whole
        assert [ch.index for ch in load.chunks] == [0, 1, 2]
        assert [ch.block_ids[:2] for ch in load.chunks[:2]] == [[-1, -1], [-1, -1]]
        assert all(b > 0 for ch in load.chunks for b in ch.block_ids[2:])
        assert all(b > 0 for b in load.chunks[2].block_ids)

        # Without chunk 2's window object the longest prefix whose window is
        # stored is 128 tokens (window: chunk 1); never a load without it.
        for k in window[2]:
            c.remove(k, force=True)
        hit, (load,) = _hit(tiny_sliding_model, master, toks, "c")
        assert hit == 128 and [ch.index for ch in load.chunks] == [0, 1]
        assert load.chunks[0].block_ids[:2] == [-1, -1]
        assert all(b > 0 for b in load.chunks[1].block_ids)
        for k in window[1]:
            c.remove(k, force=True)
        assert _hit(tiny_sliding_model, master, toks, "d") == (0, [])


def test_a_mamba_group_without_prefix_caching_turns_the_pool_off(tiny_sliding_model: str,
                                                                  master: str) -> None:
    """A KV-cache group holding Mamba state that vLLM keeps for whole
    sequences only (``mamba_cache_mode="none"``: prefix caching off): no
    state a prefix could resume from, so kvpool misses every prefix and
    stores nothing (never a load of the attention KV without the state).
    In "align" mode the group is a state group: the pool is on, with
    chunks of one block (vLLM checkpoints states at block boundaries)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvpool.connector.vllm import KVPoolConnector

    for mode in ("none", "align"):
        mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.float32,),
                          mamba_cache_mode=mode)
        groups = [*_attention_groups()[1:], KVCacheGroupSpec(SW_LAYERS, mamba)]
        kcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        conn = KVPoolConnector(_vllm_config(tiny_sliding_model, master),
                               KVConnectorRole.SCHEDULER, kcc)
        try:
            sched = conn._sched
            assert sched is not None
            toks = list(range(7, 207))
            if mode == "none":
                assert "MambaSpec" in conn.unsupported and "align" in conn.unsupported
                assert not sched.load_enabled and not sched.save_enabled
                assert conn.get_num_new_matched_tokens(_request("m", toks), 0) == (0, False)
                continue
            assert conn.unsupported == "" and sched.load_enabled and sched.save_enabled
            assert sched.state_groups == [2] and len(sched.cache_groups) == 1
            assert conn.keys.chunk_size == BLOCK and conn.cfg.load_async
            # nothing stored: a miss (the state lookup rides the same query)
            assert conn.get_num_new_matched_tokens(_request("a", toks), 0) == (0, False)
        finally:
            conn.shutdown()
