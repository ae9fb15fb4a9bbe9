"""Worker side against a real kvpool master + node daemon, on CPU tensors laid
out as vLLM 0.32 lays out paged KV caches. Needs torch (the vllm extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.layout import LayerLayout, consecutive_run
from kvpool.connector.metadata import ChunkRef, ConnectorMeta, LoadSpec, SaveSpec
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import KVPoolWorker
from kvpool.core.config import ConfigError
from support.vllm_engine import drive_step

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch not importable (the vllm extra)"
)
pytestmark = [pytest.mark.vllm, needs_torch]

NB, HEADS, BLOCK, HEAD = 16, 2, 32, 32  # num_blocks, kv heads, block size, head size
KS = KeySpace("tiny", "bfloat16", BLOCK, 2 * BLOCK)  # 2 blocks per chunk
LAYERS = 3


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="32MiB"):
        yield m.address


def _caches(layout: str = "LBHNC", seed: int = 0) -> dict[str, Any]:
    """Per-layer [num_blocks, H, N, 2*C] views over one backing buffer (as vLLM allocates)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if layout == "LBHNC":  # layer outermost: CPU backend's layout
        buf = torch.randn(LAYERS, NB, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
        return {f"model.layers.{i}.attn": buf[i] for i in range(LAYERS)}
    if layout == "BLHNC":  # block outermost: layers of one block are adjacent
        buf = torch.randn(NB, LAYERS, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
        return {f"model.layers.{i}.attn": buf[:, i] for i in range(LAYERS)}
    if layout == "separate":  # one allocation per layer: gathered layer by layer
        return {f"model.layers.{i}.attn":
                torch.randn(NB, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
                for i in range(LAYERS)}
    raise ValueError(layout)


def _worker(address: str, caches: dict[str, Any], **kw: Any) -> KVPoolWorker:
    cfg = ConnectorConfig(master_address=address, chunk_size=KS.chunk_size, **kw)
    w = KVPoolWorker(cfg, KS, StoreAccess(cfg))
    w.register_kv_caches(caches)
    return w


def _chunks(blocks: list[list[int]], seed: int = 1) -> list[ChunkRef]:
    hashes = KS.chunk_hashes([seed] * (KS.chunk_size * len(blocks)))
    return [ChunkRef(i, h, b) for i, (h, b) in enumerate(zip(hashes, blocks, strict=True))]


def _blocks(caches: dict[str, Any], ids: list[int]) -> list[Any]:
    return [t[ids].clone() for t in caches.values()]


def test_layout_of_vllm_views() -> None:
    c = _caches("LBHNC")
    lay = LayerLayout.from_tensor("l0", 0, c["model.layers.0.attn"])
    assert lay.block_bytes == HEADS * BLOCK * 2 * HEAD * 2 and lay.dense
    assert lay.num_blocks == NB
    b = _caches("BLHNC")
    lay = LayerLayout.from_tensor("l1", 1, b["model.layers.1.attn"])
    assert not lay.dense and lay.block_stride == LAYERS * lay.block_bytes
    # Heads outside the block (LHBNC) split a block into pieces: refused clearly.
    import torch

    t = torch.zeros(HEADS, NB, BLOCK, 2 * HEAD).permute(1, 0, 2, 3)
    with pytest.raises(ConfigError, match="block-contiguous"):
        LayerLayout.from_tensor("bad", 0, t)
    assert consecutive_run([4, 5, 6]) and not consecutive_run([4, 6])


def test_object_layout_gather_scatter_all_layouts() -> None:
    """An object is [head][layer][block][token...] over a layer group and a head
    range; the single-kernel path (one shared allocation) and the per-layer
    path agree byte for byte, for whole objects, layer subsets and head subsets."""
    import torch

    from kvpool.connector.layout import ObjectLayout

    objs = {}
    for layout in ("LBHNC", "BLHNC", "separate"):
        c = _caches(layout, seed=7)
        views = list(c.values())
        lays = [LayerLayout.from_tensor(n, i, t, heads=HEADS)
                for i, (n, t) in enumerate(c.items())]
        assert lays[0].heads == HEADS and lays[0].unit_bytes == BLOCK * 2 * HEAD * 2
        ol = ObjectLayout(lays, 2)
        assert ol.single_kernel == (layout != "separate")
        ob = ol.object_bytes(range(LAYERS), HEADS)
        assert ob == 2 * LAYERS * lays[0].block_bytes
        out = torch.zeros(2 * ob, dtype=torch.uint8)
        ol.gather([[5, 2], [7, 8]], range(LAYERS), 0, HEADS, out)
        for ci, ids in enumerate([[5, 2], [7, 8]]):
            want = torch.cat([views[li][b, h].reshape(-1).view(torch.uint8)
                              for h in range(HEADS) for li in range(LAYERS) for b in ids])
            assert out[ci * ob : (ci + 1) * ob].equal(want)
        objs[layout] = out
        # layers 1-2, head 1 only: the matching slice of the full object's order
        part = torch.zeros(ol.object_bytes([1, 2], 1), dtype=torch.uint8)
        ol.gather([[5, 2]], [1, 2], 1, 2, part)
        want = torch.cat([views[li][b, 1].reshape(-1).view(torch.uint8)
                          for li in (1, 2) for b in (5, 2)])
        assert part.equal(want)
        # scatter chunk 1's object into blocks 0,1 but only its second block (range 1:2)
        before = [lay.blocks[0].clone() for lay in lays]
        ol.scatter([[0, 1]], range(LAYERS), 0, HEADS, out[ob:], [(1, 2)])
        for lay, b in zip(lays, before, strict=True):
            assert lay.blocks[0].equal(b) and lay.blocks[1].equal(lay.blocks[8])
        with pytest.raises(ConfigError):
            ol.gather([[0, NB]], range(LAYERS), 0, HEADS, out)
        kept = [lay.blocks.clone() for lay in lays]
        ol.warm_up(torch.empty(ob, dtype=torch.uint8))  # writes no block
        assert all(lay.blocks.equal(k) for lay, k in zip(lays, kept, strict=True))
    # same generator sequence: layer-outermost and separate layers hold the same values
    assert objs["LBHNC"].equal(objs["separate"])


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "reversed"])
def test_consecutive_blocks_take_one_strided_copy(layout: str) -> None:
    """Chunks whose blocks are one run of consecutive ids (and layers of one
    allocation, in memory order) are gathered and scattered by one strided
    copy; the bytes are those of the indexed copy, for layer and head subsets;
    any other block order, and layers stored last to first, take the indexed
    copy."""
    import random

    import torch

    from kvpool.connector.layout import ObjectLayout

    def views(seed: int) -> list[Any]:
        g = torch.Generator().manual_seed(seed)
        if layout == "LBHNC":
            buf = torch.randn(LAYERS, NB, HEADS, BLOCK, 2 * HEAD, generator=g)
            return list(buf.to(torch.bfloat16))
        if layout == "LBNHC":  # CUDA's default: tokens outside heads
            buf = torch.randn(LAYERS, NB, BLOCK, HEADS, 2 * HEAD, generator=g)
            return [t.permute(0, 2, 1, 3) for t in buf.to(torch.bfloat16)]
        if layout == "reversed":  # layer i at the i-th slot from the end
            buf = torch.randn(LAYERS, NB, HEADS, BLOCK, 2 * HEAD, generator=g)
            return list(buf.to(torch.bfloat16))[::-1]
        buf = torch.randn(NB, LAYERS, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
        return [buf[:, i] for i in range(LAYERS)]

    def layout_of(vs: list[Any]) -> ObjectLayout:
        return ObjectLayout([LayerLayout.from_tensor(f"l{i}", i, t, heads=HEADS)
                             for i, t in enumerate(vs)], 2)

    def as_bytes(vs: list[Any]) -> list[Any]:
        return [v.contiguous().view(torch.uint8) for v in vs]

    rnd = random.Random(5)
    strided = 0
    for trial in range(24):
        fast_views, ref_views = views(trial), views(trial)
        fast, ref = layout_of(fast_views), layout_of(ref_views)
        ref._run_view = lambda *a: None  # type: ignore[method-assign]  # the indexed copy
        l0 = rnd.randrange(LAYERS)
        sel = list(range(l0, rnd.randrange(l0 + 1, LAYERS + 1)))
        h0 = rnd.randrange(HEADS)
        h1 = rnd.randrange(h0 + 1, HEADS + 1)
        n = rnd.randrange(1, 4)
        b0 = rnd.randrange(0, NB - 2 * n + 1)
        ids = [[b0 + 2 * c, b0 + 2 * c + 1] for c in range(n)]
        if trial % 4 == 0:
            ids = ids[::-1]  # one chunk: still a run; more: indexed
        flat = [b for chunk in ids for b in chunk]
        is_run = flat == list(range(flat[0], flat[0] + len(flat))) \
            and (layout != "reversed" or len(sel) == 1)
        assert (fast._run_view(ids, sel, h0, h1) is not None) == is_run
        strided += is_run
        nbytes = n * fast.object_bytes(sel, h1 - h0)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(trial))
        fast.scatter(ids, sel, h0, h1, src)
        ref.scatter(ids, sel, h0, h1, src)
        assert all(a.equal(b) for a, b in zip(as_bytes(fast_views), as_bytes(ref_views),
                                              strict=True)), (trial, ids, sel, h0, h1)
        out, out_ref = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes,
                                                                          dtype=torch.uint8)
        fast.gather(ids, sel, h0, h1, out)
        ref.gather(ids, sel, h0, h1, out_ref)
        assert out.equal(src) and out_ref.equal(src)
    # both paths were taken (stored last to first: single layers only)
    assert (1 if layout == "reversed" else 12) <= strided < 24


@pytest.mark.parametrize("layout", ["LBNHC", "separate"])
def test_staging_alignment_picks_the_copy_word(layout: str) -> None:
    """Rows move as 16-byte words when the staging buffer allows, else 8 or 1:
    the same bytes whatever the buffer's alignment, strided and indexed paths."""
    import torch

    from kvpool.connector.layout import ObjectLayout

    def views(seed: int) -> list[Any]:
        g = torch.Generator().manual_seed(seed)
        if layout == "separate":
            return [torch.randn(NB, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
                    for _ in range(LAYERS)]
        buf = torch.randn(LAYERS, NB, BLOCK, HEADS, 2 * HEAD, generator=g)
        return [t.permute(0, 2, 1, 3) for t in buf.to(torch.bfloat16)]

    def layout_of(vs: list[Any]) -> ObjectLayout:
        return ObjectLayout([LayerLayout.from_tensor(f"l{i}", i, t, heads=HEADS)
                             for i, t in enumerate(vs)], 2)

    for ids in ([[4, 5], [6, 7]], [[9, 1], [3, 12]]):  # a run (strided), then indexed
        ref_views = views(3)
        ref = layout_of(ref_views)
        assert ref._word == 16
        nbytes = 2 * ref.object_bytes(range(LAYERS), HEADS)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(1))
        ref.scatter(ids, range(LAYERS), 0, HEADS, src)
        want = torch.empty(nbytes, dtype=torch.uint8)
        ref.gather(ids, range(LAYERS), 0, HEADS, want)
        assert want.equal(src)
        for shift, word in ((16, 16), (8, 8), (4, 1), (1, 1)):
            vs = views(3)
            ol = layout_of(vs)
            raw = torch.zeros(nbytes + 64, dtype=torch.uint8)
            pad = (-raw.data_ptr()) % 16 + shift  # exactly ``shift`` past a 16-byte boundary
            staged = raw[pad : pad + nbytes]
            assert ol._word_for(staged) == word, (shift, ol._word_for(staged))
            staged.copy_(src)
            ol.scatter(ids, range(LAYERS), 0, HEADS, staged)
            assert all(a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
                       for a, b in zip(vs, ref_views, strict=True)), (ids, shift)
            staged.zero_()
            ol.gather(ids, range(LAYERS), 0, HEADS, staged)
            assert staged.equal(src), (ids, shift)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "separate"])
def test_save_then_load_into_other_blocks(pool: str, layout: str) -> None:
    src = _caches(layout, seed=1)
    w = _worker(pool, src)
    chunks = _chunks([[2, 3], [4, 5]], seed=len(layout) + ord(layout[0]))
    assert w.save([SaveSpec("r", chunks)]) == 2
    tot = w.stats.totals()
    assert tot["saved_bytes"] == 2 * LAYERS * w.keys.blocks_per_chunk * w.layers[0].block_bytes
    # one object per chunk and layer group (3 layers: 3 groups), one batch per group
    assert tot["staged_objects"] == 2 * LAYERS and tot["save_batches"] == LAYERS
    assert w.save([SaveSpec("r", chunks)]) == 0  # already stored: skipped
    assert w.stats.totals()["skipped_chunks"] == 2
    want = _blocks(src, [2, 3, 4, 5])
    w.close()

    dst = _caches(layout, seed=2)
    w2 = _worker(pool, dst)
    # Scattered destination blocks, then a consecutive run.
    load = [ChunkRef(c.index, c.hash, b) for c, b in zip(chunks, [[9, 1], [12, 13]], strict=True)]
    res = w2.load(LoadSpec("q", load))
    assert res.failed_block_ids == set() and res.loaded_chunks == 2
    got = _blocks(dst, [9, 1, 12, 13])
    for a, b in zip(want, got, strict=True):
        assert a.equal(b)
    untouched = _caches(layout, seed=2)
    for t, u in zip(dst.values(), untouched.values(), strict=True):
        assert t[[0, 2, 3, 4]].equal(u[[0, 2, 3, 4]])
    w2.close()


def test_skip_blocks_and_missing_chunks(pool: str) -> None:
    src = _caches(seed=3)
    w = _worker(pool, src)
    chunks = _chunks([[0, 1], [2, 3], [4, 5]], seed=42)
    w.save([SaveSpec("r", chunks[:2])])  # chunk 2 never stored
    dst = _caches(seed=4)
    before = _blocks(dst, [6])
    w2 = _worker(pool, dst)
    load = [ChunkRef(c.index, c.hash, b) for c, b in zip(chunks, [[6, 7], [8, 9], [10, 11]],
                                                             strict=True)]
    res = w2.load(LoadSpec("q", load, skip_blocks=1))
    assert res.failed_block_ids == {10, 11} and res.loaded_chunks == 2
    # Only the first block of the last chunk (the last block is vLLM's to compute).
    keep = _blocks(dst, [13])
    res = w2.load(LoadSpec("t", [ChunkRef(1, chunks[1].hash, [12, 13])], last_blocks=1))
    assert res.failed_block_ids == set()
    assert all(a.equal(b) for a, b in zip(_blocks(src, [2]), _blocks(dst, [12]), strict=True))
    assert all(a.equal(b) for a, b in zip(keep, _blocks(dst, [13]), strict=True))
    after = _blocks(dst, [6])
    assert all(a.equal(b) for a, b in zip(before, after, strict=True))  # skipped block kept
    assert all(a.equal(b) for a, b in zip(_blocks(src, [1, 2, 3]), _blocks(dst, [7, 8, 9]),
                                          strict=True))
    w.close()
    w2.close()


def test_store_down_fails_loads_not_requests() -> None:
    from kvpool.cluster.processes import find_free_port

    addr = f"127.0.0.1:{find_free_port()}"
    w = _worker(addr, _caches(), rpc_timeout_s=0.3)
    chunks = _chunks([[0, 1]])
    assert drive_step(w, ConnectorMeta(loads=[LoadSpec("q", chunks)])) == {0, 1}
    assert w.take_load_errors() == set()
    assert w.save([SaveSpec("r", chunks)]) == 0
    assert w.stats.totals()["save_errors"] == 1
    w.close()


def test_async_saves_and_loads_reported_by_get_finished(pool: str) -> None:
    src = _caches(seed=5)
    w = _worker(pool, src)
    chunks = _chunks([[0, 1]], seed=77)
    w.submit_saves(ConnectorMeta(saves=[SaveSpec("r", chunks)]))
    assert w.get_finished(set()) == (set(), set())  # not finished yet: nothing to report
    assert w.wait_saves(timeout=30)
    assert w.get_finished({"r", "other"}) == ({"r"}, set())  # 'other' had no saves
    assert w.get_finished({"r"}) == (set(), set())  # reported once
    dst = _caches(seed=6)
    w2 = _worker(pool, dst)
    w2.start_load(ConnectorMeta(loads=[LoadSpec("q", [ChunkRef(0, chunks[0].hash, [3, 4])],
                                                is_async=True)]))
    for _ in range(300):
        _, recving = w2.get_finished(set())
        if recving:
            break
        import time

        time.sleep(0.01)
    assert recving == {"q"}
    assert w2.take_load_errors() == set()
    assert all(a.equal(b) for a, b in zip(_blocks(src, [0, 1]), _blocks(dst, [3, 4]),
                                          strict=True))
    w.close()
    w2.close()


@pytest.mark.parametrize("layout", ["LBHNC", "separate"])
def test_groups_smaller_than_request_and_partial_group_failure(pool: str, layout: str) -> None:
    """staging_mib below the request: chunks move in batches (one store batch
    each); a chunk with a missing object fails alone, the others land."""
    src = _caches(layout, seed=11)
    w = _worker(pool, src, staging_mib=0.1)  # 2 chunk objects of 48 KiB per group
    assert w.geo is not None and w.geo.chunks_per_buffer(w.cfg.staging_mib) == 2
    chunks = _chunks([[0, 1], [2, 3], [4, 5]], seed=900 + len(layout))
    assert w.save([SaveSpec("r", [chunks[0], chunks[2]])]) == 2
    assert w.stats.totals()["save_batches"] == LAYERS  # per layer group, 2 chunks each
    assert w.save([SaveSpec("r", chunks)]) == 1  # two skipped, one written
    dst = _caches(layout, seed=12)
    w2 = _worker(pool, dst, staging_mib=0.1)
    w.store.call(lambda c: c.remove(w.object_key(chunks[1].hash, 1, (0, 1)), force=True))
    load = [ChunkRef(c.index, c.hash, b)
            for c, b in zip(chunks, [[15, 14], [9, 8], [7, 1]], strict=True)]
    res = w2.load(LoadSpec("q", load, skip_blocks=1, last_blocks=1))
    assert res.failed_block_ids == {9, 8} and res.loaded_chunks == 2
    assert all(a.equal(b) for a, b in zip(_blocks(src, [1, 4]), _blocks(dst, [14, 7]),
                                          strict=True))
    untouched = _caches(layout, seed=12)
    for t, u in zip(dst.values(), untouched.values(), strict=True):
        assert t[[15, 1]].equal(u[[15, 1]])  # skipped first / not-loaded last blocks
    w.close()
    w2.close()


@pytest.mark.parametrize("blocks", [[[6, 7], [8, 9]], [[9, 6], [13, 2]]])
def test_layerwise_first_group_scatter_made_ahead(pool: str, blocks: list[list[int]]) -> None:
    """A layer-wise load into one run of blocks makes its first group's copy
    before the data arrives (one call when the first layer waits); into other
    blocks it makes none and scatters as usual. Every byte lands either way."""
    from kvpool.connector.layout import ObjectLayout

    src = _caches("LBHNC", seed=21)
    w = _worker(pool, src)
    chunks = _chunks([[0, 1], [2, 3]], seed=31 + blocks[0][0])  # own keys per case
    assert w.save([SaveSpec("r", chunks)]) == 2
    dst = _caches("LBHNC", seed=22)
    w2 = _worker(pool, dst)
    made: list[Any] = []
    real = ObjectLayout.prepared_scatter

    def spy(self: ObjectLayout, *a: Any, **kw: Any) -> Any:
        made.append(real(self, *a, **kw))
        return made[-1]

    ObjectLayout.prepared_scatter = spy  # type: ignore[method-assign]
    try:
        load = [ChunkRef(c.index, c.hash, b) for c, b in zip(chunks, blocks, strict=True)]
        assert drive_step(w2, ConnectorMeta(loads=[LoadSpec("q", load)])) == set()
    finally:
        ObjectLayout.prepared_scatter = real  # type: ignore[method-assign]
    run = blocks[0] == [6, 7]
    assert len(made) == 1 and (made[0] is not None) == run, made
    flat = [b for ids in blocks for b in ids]
    assert all(a.equal(b) for a, b in zip(_blocks(src, [0, 1, 2, 3]), _blocks(dst, flat),
                                          strict=True))
    w.close()
    w2.close()


def test_layerwise_load_reads_first_group_from_the_lookup(pool: str) -> None:
    """The scheduler's lookup hands its answers for the first layer group to
    the worker (``LoadSpec.located``): the layer-wise load then asks the master
    only for the later groups' objects, and every byte lands."""
    from kvpool.connector.keys import layer_ranges
    from kvpool.connector.scheduler import KVPoolScheduler, NewReq, StepInfo

    src = _caches("LBHNC", seed=41)
    w = _worker(pool, src)
    toks = [41] * (KS.chunk_size * 2) + [7]  # two whole chunks and one more token
    chunks = [ChunkRef(i, h, [2 * i, 2 * i + 1])
              for i, h in enumerate(KS.chunk_hashes(toks[: 2 * KS.chunk_size]))]
    assert w.save([SaveSpec("r", chunks)]) == 2
    cfg = ConnectorConfig(master_address=pool, chunk_size=KS.chunk_size)
    assert w.geo is not None
    heads = w.geo.heads.total  # as the worker names its objects
    sched = KVPoolScheduler(cfg, KS, LAYERS, StoreAccess(cfg), num_heads=heads)
    n, _ = sched.lookup("q", toks, 0)
    assert n == 2 * KS.chunk_size
    blocks = [9, 10, 5, 6, 11]
    sched.after_alloc("q", None, toks, [blocks], n)
    meta = sched.build_meta(StepInfo(new=[NewReq("q", [blocks], 0)],
                                     num_scheduled_tokens={"q": len(toks)}))
    (spec,) = meta.loads
    first = layer_ranges(LAYERS, cfg.layer_groups)[0]
    assert spec.located is not None
    assert spec.located.keys == [KS.object_key(c.hash, first, (0, heads), heads)
                                 for c in chunks]
    dst = _caches("LBHNC", seed=42)
    w2 = _worker(pool, dst)
    # every locate of a client goes through its master session's locate
    session = w2.store.client()._parts.session
    asked: list[list[str]] = []
    real = session.locate

    def counting(ks: list[str]) -> Any:
        asked.append(list(ks))
        return real(ks)

    session.locate = counting  # type: ignore[method-assign]
    assert drive_step(w2, meta) == set()
    assert len(asked) == 1 and not set(asked[0]) & set(spec.located.keys), asked
    assert all(a.equal(b) for a, b in zip(_blocks(src, [0, 1, 2, 3]),
                                          _blocks(dst, [9, 10, 5, 6]), strict=True))
    sched.store.close()
    w.close()
    w2.close()


def test_two_cache_groups_share_tensors_and_skip_null_blocks(pool: str) -> None:
    """vLLM's hybrid KV-cache manager: layer j of each KV-cache group views the
    same tensor, each group indexing it with its own block ids. Objects are
    per group; a save stores a group's chunk only when the request holds all
    its blocks there, and a load writes only the blocks the request holds
    (-1: a sliding window's null blocks) and reads nothing for a group that
    holds none of a chunk."""
    import torch

    g = torch.Generator().manual_seed(5)
    buf = torch.randn(2, NB, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
    # group 0 (sliding): layers 0, 2; group 1 (full): layers 1, 3; 0/1 and 2/3 alias
    caches = {"l0": buf[0], "l1": buf[0], "l2": buf[1], "l3": buf[1]}
    order = {"l0": 0, "l2": 1, "l1": 2, "l3": 3}
    cfg = ConnectorConfig(master_address=pool, chunk_size=KS.chunk_size, layer_groups=1)
    w = KVPoolWorker(cfg, KS, StoreAccess(cfg))
    w.register_kv_caches(caches, order, None, {"l0": 0, "l2": 0, "l1": 1, "l3": 1})
    try:
        assert w.geo is not None and w.geo.cache_sizes == [2, 2]
        assert len(w.geo.layers) == 4  # shared tensors are no KV-sharing aliases
        hashes = KS.chunk_hashes([9] * (KS.chunk_size * 2))
        # chunk 0: the sliding group lost its blocks (-1); chunk 1: both held
        src = [ChunkRef(0, hashes[0], [-1, -1, 4, 5]), ChunkRef(1, hashes[1], [6, 7, 8, 9])]
        assert w.save([SaveSpec("r", src)]) == 2
        keys = [w.object_key(h, gi, (0, 1)) for h in hashes for gi in range(2)]
        assert "/g0of2/" in keys[0] and "/g1of2/" in keys[1]
        assert w.store.call(lambda c: c.batch_exists(keys)) == [False, True, True, True]
        before = buf.clone()
        dst = [ChunkRef(0, hashes[0], [-1, -1, 10, 11]), ChunkRef(1, hashes[1], [12, 13, 14, 15])]
        res = w.load(LoadSpec("q", dst))
        assert res.failed_block_ids == set() and res.loaded_chunks == 2
        for pos in (0, 1):  # layer position in each group's tensor
            t = buf[pos]
            assert torch.equal(t[[10, 11]], before[pos][[4, 5]])  # full group, chunk 0
            assert torch.equal(t[[12, 13]], before[pos][[6, 7]])  # sliding group, chunk 1
            assert torch.equal(t[[14, 15]], before[pos][[8, 9]])  # full group, chunk 1
        unwritten = [b for b in range(NB) if b not in (10, 11, 12, 13, 14, 15)]
        assert torch.equal(buf[:, unwritten], before[:, unwritten])
        # a chunk whose window object is missing fails as a whole request
        miss = ChunkRef(0, hashes[0], [2, 3, 10, 11])
        res = w.load(LoadSpec("m", [miss]))
        assert res.failed_block_ids == {2, 3, 10, 11}
        # as vLLM runs it (async): block ids name no request with several
        # groups, so the request is reported (vLLM's failed_recving)
        w.start_load(ConnectorMeta(loads=[LoadSpec("m2", [miss], is_async=True)]))
        w.loads._loader.submit(lambda: None).result(timeout=30)  # the load ran
        assert w.get_finished(set())[1] == {"m2"}
        assert w.take_failed_requests() == {"m2"} and w.take_load_errors() == set()
    finally:
        w.close()


# ---------------------------------------------------------------- recurrent state

STATE_KS = KeySpace("tiny-gdn", "bfloat16", BLOCK, BLOCK)  # a state model: chunk = block
STATE_BYTES, STATE_PAGE = 3000, 4096  # a layer's state in a block, and the padded page


def _state_layers(seed: int) -> list[tuple[str, Any]]:
    """Two state layers as vLLM 0.32 hands a GDN layer over: an int8
    ``[blocks, 1, 1, state bytes]`` view of padded pages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in (0, 2):
        pages = torch.randint(-128, 127, (NB, STATE_PAGE), generator=g, dtype=torch.int8)
        out.append((f"model.layers.{i}.linear_attn",
                    pages[:, :STATE_BYTES].view(NB, 1, 1, STATE_BYTES)))
    return out


def _state_worker(address: str, seed: int) -> tuple[KVPoolWorker, dict[str, Any],
                                                    list[tuple[str, Any]]]:
    cfg = ConnectorConfig(master_address=address, chunk_size=BLOCK)
    w = KVPoolWorker(cfg, STATE_KS, StoreAccess(cfg))
    caches = _caches(seed=seed)
    w.register_kv_caches(caches)
    states = _state_layers(seed)
    w.register_state_caches([states])
    return w, caches, states


def test_state_saved_from_its_block_and_loaded_into_another(pool: str) -> None:
    """A state is stored per layer from the exact block vLLM handed over and
    restored into the block a hit gets, byte for byte, beside its chunks; a
    load missing any layer's state, or without a block for it, fails the
    whole request (vLLM recomputes it), never a partial resume."""
    import torch

    from kvpool.connector.metadata import StateRef
    from kvpool.store import Client, ClientConfig

    with Client(ClientConfig(master_address=pool)) as c:
        c.remove_all(force=True)
    w1, caches1, states1 = _state_worker(pool, seed=3)
    hashes = STATE_KS.chunk_hashes([5] * (3 * BLOCK))
    chunks = [ChunkRef(i, hashes[i], [b]) for i, b in enumerate([4, 9, 2])]
    state = StateRef(0, 2, hashes[2], 11, pin=5)
    try:
        assert w1.save([SaveSpec("r", chunks, [state])]) == 3
        assert w1.stats.totals()["saved_states"] == 1
        report = w1.take_report()
        assert report is not None and report.states_saved == [5]  # its block may go
    finally:
        w1.close()
    with Client(ClientConfig(master_address=pool)) as c:
        keys = STATE_KS.state_keys(hashes[2], 0, 2, 1)
        assert [c.get(k) for k in keys] == [
            t[11].contiguous().view(-1).numpy().tobytes() for _, t in states1]

    w2, caches2, states2 = _state_worker(pool, seed=4)
    try:
        dest = [ChunkRef(i, hashes[i], [b]) for i, b in enumerate([1, 5, 6])]
        res = w2.load(LoadSpec("q", dest, is_async=True, states=[StateRef(0, 2, hashes[2], 7)]))
        assert res.failed_block_ids == set() and res.loaded_chunks == 3
        for (_, a), (_, b) in zip(states1, states2, strict=True):
            assert torch.equal(a[11], b[7])
        for n in caches1:
            assert torch.equal(caches1[n][[4, 9, 2]], caches2[n][[1, 5, 6]])
        assert w2.stats.totals()["loaded_states"] == 1

        before = [t[8].clone() for _, t in states2]
        res = w2.load(LoadSpec("q2", dest[:2], is_async=True,
                               states=[StateRef(0, 1, hashes[1], 8)]))  # never stored
        assert res.failed_block_ids >= {1, 5} and res.loaded_chunks == 0
        assert all(torch.equal(b, t[8]) for b, (_, t) in zip(before, states2, strict=True))
        res = w2.load(LoadSpec("q3", dest, is_async=True, states=[StateRef(0, 2, hashes[2], -1)]))
        assert res.failed_block_ids and res.loaded_chunks == 0

        # the async path reports such a request as failed as a whole (failed_recving)
        with Client(ClientConfig(master_address=pool)) as c:
            c.remove(keys[1], force=True)
        meta = ConnectorMeta(loads=[LoadSpec("q4", dest, is_async=True,
                                             states=[StateRef(0, 2, hashes[2], 7)])])
        w2.start_load(meta)
        w2.end_step(meta)
        done: set[str] = set()
        for _ in range(200):
            done |= w2.get_finished(set())[1]
            if "q4" in done:
                break
            import time

            time.sleep(0.01)
        assert "q4" in done
        assert w2.take_failed_requests() == {"q4"}
    finally:
        w2.close()


def test_state_layers_that_cannot_be_stored_still_fail_loads_per_request(pool: str) -> None:
    """A state layer kvpool cannot lay out (the adapter logs it and goes on):
    a load carrying a state fails, reported per request as vLLM needs with
    several KV-cache groups, never per block."""
    import torch

    from kvpool.connector.metadata import StateRef

    cfg = ConnectorConfig(master_address=pool, chunk_size=BLOCK)
    w = KVPoolWorker(cfg, STATE_KS, StoreAccess(cfg))
    try:
        w.register_kv_caches(_caches(seed=5))
        with pytest.raises(ConfigError):
            w.register_state_caches([[("model.layers.0.linear_attn", torch.zeros(NB))]])
        hashes = STATE_KS.chunk_hashes([6] * BLOCK)
        spec = LoadSpec("q", [ChunkRef(0, hashes[0], [3])], is_async=True,
                        states=[StateRef(0, 0, hashes[0], 4)])
        w.loads._load_async(spec)
        assert w.take_failed_requests() == {"q"} and w.take_load_errors() == set()
    finally:
        w.close()
