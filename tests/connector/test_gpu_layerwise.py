"""Layer-wise loads on a CUDA device: the scatters run on a stream of their
own, and the forward's kernels must still see every loaded byte (skipped
where no CUDA device exists; the CPU path is tests/connector/test_worker.py).

The forward here is slow on purpose: a queue of matmuls before each layer's
read keeps the forward's stream far behind the host, so a read that did not
wait for its group's scatter would see the zeros written before the load.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec, SaveSpec
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import HeadSpec, KVPoolWorker


def _cuda() -> tuple[bool, str]:
    if importlib.util.find_spec("torch") is None:
        return False, "torch not importable"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, ""


_ok, _why = _cuda()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ok, reason=_why)]

L, NB, N, H, C = 8, 64, 16, 4, 128  # layers, blocks, block tokens, kv heads, 2 * head size
KS = KeySpace("gpu-layerwise", "bfloat16", N, 4 * N)  # 4 blocks per chunk
CHUNKS = 6


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="256MiB"):
        yield m.address


def test_layerwise_load_visible_to_a_lagging_forward(pool: str) -> None:
    import torch

    # vLLM's CUDA layout: one allocation [L, blocks, tokens, heads, 2*head], viewed per layer
    kv = torch.randn(L, NB, N, H, C, dtype=torch.bfloat16, device="cuda")
    caches = {f"model.layers.{i}.self_attn.attn": kv[i].permute(0, 2, 1, 3) for i in range(L)}
    cfg = ConnectorConfig(master_address=pool, chunk_size=KS.chunk_size, layer_groups=4,
                          load_or_recompute=False, load_timeout_s=30.0)
    w = KVPoolWorker(cfg, KS, StoreAccess(cfg), heads=HeadSpec(0, H, H, True))
    try:
        w.register_kv_caches(caches)
        bpc = KS.blocks_per_chunk
        src = list(range(CHUNKS * bpc))
        dst = list(range(NB - CHUNKS * bpc, NB))
        hashes = KS.chunk_hashes(list(range(CHUNKS * KS.chunk_size)))
        w.save([SaveSpec("r", [ChunkRef(i, h, src[i * bpc:(i + 1) * bpc])
                               for i, h in enumerate(hashes)])])
        meta = ConnectorMeta(loads=[LoadSpec("r", [
            ChunkRef(i, h, dst[i * bpc:(i + 1) * bpc]) for i, h in enumerate(hashes)])])
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(3):
            kv[:, dst].zero_()
            torch.cuda.synchronize()
            w.layerwise = True
            w.start_load(meta)
            seen = []
            for i, name in enumerate(caches):
                for _ in range(20):  # keep the forward's stream behind the host
                    a = torch.tanh(a @ a)
                w.wait_for_layer(name)
                seen.append(kv[i, dst].clone())  # what this layer's attention would read
            w.end_step(None)
            torch.cuda.synchronize()
            assert not w.take_load_errors()
            for i in range(L):
                assert torch.equal(seen[i], kv[i, src]), f"layer {i} read before its load"
        assert w.geo is not None and [b - a for a, b in w.geo.group_keys] == [1, 2, 2, 3]
    finally:
        w.close()
        w.store.close()
