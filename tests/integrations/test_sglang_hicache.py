"""kvpool.integrations.sglang against a real master and node daemon, driven by
SGLang's own call sequences (tests/integrations/sglang_replay.py, pinned to
SGLang 0.5.23), and by SGLang's own classes where SGLang imports."""

from __future__ import annotations

import inspect
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sglang_replay import (  # noqa: E402
    Controller,
    MambaHostPool,
    MHAHostPool,
    MLAHostPool,
    fill_pages,
    load_dynamic_backend,
    page_hashes,
    real_sglang_mamba_pool,
    real_sglang_pool,
    storage_config,
)

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess  # noqa: E402
from kvpool.core.config import ConfigError  # noqa: E402
from kvpool.integrations import _sglang_api, sglang  # noqa: E402
from kvpool.integrations.sglang import (  # noqa: E402
    KVPoolHiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

PAGE = 4


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    with MasterProcess(data_dir=str(tmp_path_factory.mktemp("master")), lease_ttl_ms=1000) as m:
        yield m


@pytest.fixture(scope="module")
def daemon(master: MasterProcess) -> Iterator[NodeDaemonProcess]:
    with NodeDaemonProcess(master.address, "64MiB") as d:
        yield d


@pytest.fixture
def make_engine(master: MasterProcess, daemon: NodeDaemonProcess
                ) -> Iterator[Callable[..., Controller]]:
    """``make(pool, **storage_config kwargs)``: one engine rank with the backend
    loaded as SGLang's dynamic backend (its own kvpool client); a model name
    unique to the test, so tests share no pages."""
    model = f"org/m-{uuid.uuid4().hex[:8]}"
    made: list[Any] = []

    def make(pool: Any, interface_v1: int = 1, **kw: Any) -> Controller:
        extra = {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
                 "class_name": "KVPoolHiCacheStorage", "interface_v1": interface_v1,
                 "master_address": master.address, **kw.pop("extra", {})}
        kw.setdefault("model", model)
        cfg = storage_config(layout=pool.layout, extra=extra, **kw)
        backend = load_dynamic_backend(cfg, pool)
        made.append(backend)
        return Controller(backend, pool, cfg, PAGE)

    yield make
    for b in made:
        b.close()


def _tokens(n_pages: int, seed: int = 0) -> list[int]:
    return [seed * 100_000 + i for i in range(n_pages * PAGE)]


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_pages_round_trip_between_two_engines(make_engine: Callable[..., Controller],
                                                 layout: str) -> None:
    """Engine A backs up 5 pages (batch_set_v1 from its host pool); engine B,
    sharing the pool, finds all 5 (batch_exists) and loads them into other host
    slots (batch_get_v1): byte for byte A's pages."""
    a = make_engine(MHAHostPool(layout=layout))
    b = make_engine(MHAHostPool(layout=layout))
    hashes = page_hashes(_tokens(5), PAGE)
    src = [0, 1, 2, 3, 4]
    fill_pages(a.pool, _slots(src), seed=1)
    assert a.backup(hashes, src) == 5 * PAGE
    hit = b.hit_query(hashes)
    assert hit == hashes
    dst = [9, 3, 11, 7, 5]
    assert b.transfer(hit, dst) == 5
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(b.pool.page(d * PAGE).view(torch.int16),
                           a.pool.page(s * PAGE).view(torch.int16))
    assert b.pool.page(0).abs().sum() == 0  # nothing else written
    assert a.calls == ["batch_set_v1"] and b.calls == ["batch_exists", "batch_get_v1"]
    # a second backup of the same pages is a success that stores nothing new
    assert all(a.backend.batch_set_v1(hashes, _slots(src)))
    # an engine of the other layout orders page bytes otherwise: a miss, not garbled pages
    other = "layer_first" if layout == "page_first" else "page_first"
    assert make_engine(MHAHostPool(layout=other)).backend.batch_exists(hashes) == 0
    # so does one of another KV dtype of the same width
    fp16 = MHAHostPool(layout=layout, dtype=torch.float16)
    assert make_engine(fp16).backend.batch_exists(hashes) == 0


def test_batch_exists_counts_the_leading_run(make_engine: Callable[..., Controller]) -> None:
    """Pages 0-2 and 4 stored, 3 not: batch_exists answers 3, the hit query stops
    there, and the prefetch loads exactly those 3; other TP ranks see none."""
    e = make_engine(MHAHostPool(pages=40))
    hashes = page_hashes(_tokens(6), PAGE)
    fill_pages(e.pool, _slots(list(range(6))), seed=2)
    assert all(e.backend.batch_set_v1(hashes[:3], _slots([0, 1, 2])))
    assert all(e.backend.batch_set_v1([hashes[4]], _slots([4])))
    assert e.backend.batch_exists(hashes) == 3
    assert e.backend.batch_exists(hashes[4:5]) == 1
    assert e.backend.batch_exists([]) == 0
    assert e.hit_query(hashes) == hashes[:3]
    assert e.transfer(hashes, [20, 21, 22, 23, 24, 25]) == 3
    assert torch.equal(e.pool.page(22 * PAGE), e.pool.page(2 * PAGE))
    assert e.pool.page(23 * PAGE).abs().sum() == 0
    other_rank = make_engine(MHAHostPool(), tp_rank=1, tp_size=2)
    assert other_rank.backend.batch_exists(hashes) == 0


def test_long_sequences_go_in_batches_of_128(make_engine: Callable[..., Controller]) -> None:
    """A 130-page prefix: SGLang backs it up, queries and loads it in two
    batches of STORAGE_BATCH_SIZE (128 + 2) pages."""
    a = make_engine(MHAHostPool(pages=300))
    hashes = page_hashes(_tokens(130, seed=12), PAGE)
    fill_pages(a.pool, _slots(list(range(130))), seed=12)
    assert a.backup(hashes, list(range(130))) == 130 * PAGE
    assert a.hit_query(hashes) == hashes
    assert a.transfer(hashes, list(range(140, 270))) == 130
    assert torch.equal(a.pool.kv_buffer[:, 140 * PAGE:270 * PAGE], a.pool.kv_buffer[:, :130 * PAGE])
    assert a.calls == ["batch_set_v1"] * 2 + ["batch_exists"] * 2 + ["batch_get_v1"] * 2


def test_backup_and_prefetch_threads_at_once(make_engine: Callable[..., Controller]) -> None:
    """SGLang's backup thread stores while its prefetch threads query and load:
    one backend, three threads, every page read is the page written."""
    e = make_engine(MHAHostPool(pages=64))
    seqs = [page_hashes(_tokens(4, seed=20 + i), PAGE) for i in range(6)]
    fill_pages(e.pool, _slots(list(range(24))), seed=20)
    errors: list[BaseException] = []

    def backup() -> None:
        for i, h in enumerate(seqs):
            assert all(e.backend.batch_set_v1(h, _slots(list(range(4 * i, 4 * i + 4)))))

    def prefetch(slot0: int) -> None:
        for _ in range(20):
            for i, h in enumerate(seqs):
                n = e.backend.batch_exists(h)
                if n:
                    dst = list(range(slot0 + 4 * (i % 2), slot0 + 4 * (i % 2) + n))
                    ok = e.backend.batch_get_v1(h[:n], _slots(dst))
                    assert all(ok)
                    for j in range(n):
                        assert torch.equal(e.pool.page(dst[j] * PAGE),
                                           e.pool.page((4 * i + j) * PAGE))

    def run(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(backup,)),
               threading.Thread(target=run, args=(prefetch, 32)),
               threading.Thread(target=run, args=(prefetch, 48))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(e.backend.batch_exists(h) == 4 for h in seqs)


def test_a_missing_page_is_a_miss(make_engine: Callable[..., Controller]) -> None:
    """Missing keys: False / None / 0, never an exception, and the host slots
    stay untouched; a found page between missing ones is still read."""
    e = make_engine(MHAHostPool())
    hashes = page_hashes(_tokens(3, seed=3), PAGE)
    fill_pages(e.pool, _slots([1]), seed=3)
    assert all(e.backend.batch_set_v1([hashes[1]], _slots([1])))
    before = e.pool.kv_buffer.clone()
    assert e.backend.batch_get_v1(hashes, _slots([5, 6, 7])) == [False, True, False]
    assert torch.equal(e.pool.page(6 * PAGE), e.pool.page(1 * PAGE))
    assert torch.equal(e.pool.kv_buffer[:, 5 * PAGE:6 * PAGE], before[:, 5 * PAGE:6 * PAGE])
    assert not e.backend.exists(hashes[0]) and e.backend.exists(hashes[1])
    assert e.backend.batch_exists(hashes) == 0
    flat = make_engine(MHAHostPool(), interface_v1=0)
    assert flat.backend.get(hashes[0], flat.pool.get_dummy_flat_data_page()) is None
    assert flat.backend.batch_get(hashes, [flat.pool.get_dummy_flat_data_page()] * 3) \
        == [None] * 3  # v1 objects are not flat pages: another format, a miss


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_is_stored_once_and_read_by_every_rank(make_engine: Callable[..., Controller],
                                                   layout: str) -> None:
    """MLA with TP 2: rank 1's backup is skipped (SGLang's backup_skip) and its
    direct batch_set_v1 stores nothing; rank 0 writes one object per page;
    rank 1 finds and reads the same objects."""
    r0 = make_engine(MLAHostPool(layout=layout), tp_rank=0, tp_size=2, mla=True)
    r1 = make_engine(MLAHostPool(layout=layout), tp_rank=1, tp_size=2, mla=True)
    hashes = page_hashes(_tokens(4, seed=4), PAGE)
    fill_pages(r1.pool, _slots([0, 1, 2, 3]), seed=44)
    assert r1.backup(hashes, [0, 1, 2, 3]) == 0 and r1.calls == []
    assert r1.backend.batch_set_v1(hashes, _slots([0, 1, 2, 3])) == [True] * 4
    assert r1.backend.batch_exists(hashes) == 0  # rank 1 wrote nothing
    fill_pages(r0.pool, _slots([0, 1, 2, 3]), seed=4)
    assert r0.backup(hashes, [0, 1, 2, 3]) == 4 * PAGE
    assert r1.hit_query(hashes) == hashes
    assert r1.transfer(hashes, [8, 9, 10, 11]) == 4
    for s in range(4):
        assert torch.equal(r1.pool.page((8 + s) * PAGE), r0.pool.page(s * PAGE))
    keys = r0.backend._keys(hashes)
    assert all("/mla/" in k for k in keys) and keys == r1.backend._keys(hashes)
    client = r0.backend.client
    assert client.batch_exists(keys) == [True] * 4
    tp_keys = [k.replace("/mla/", "/tp0of2/") for k in keys]
    assert client.batch_exists(tp_keys) == [False] * 4


def test_copying_interface_round_trip(make_engine: Callable[..., Controller]) -> None:
    """Without interface_v1 SGLang copies flat pages (get_data_page ->
    batch_set; batch_get into dummy pages -> set_from_flat_data_page)."""
    a = make_engine(MHAHostPool(layout="layer_first"), interface_v1=0)
    b = make_engine(MHAHostPool(layout="layer_first"), interface_v1=0)
    hashes = page_hashes(_tokens(3, seed=5), PAGE)
    fill_pages(a.pool, _slots([0, 1, 2]), seed=5)
    assert a.backup(hashes, [0, 1, 2]) == 3 * PAGE
    assert b.hit_query(hashes) == hashes
    assert b.transfer(hashes, [4, 5, 6]) == 3
    for s in range(3):
        assert torch.equal(b.pool.page((4 + s) * PAGE), a.pool.page(s * PAGE))
    assert a.calls == ["batch_set"] and b.calls == ["batch_exists", "batch_get"]
    page = a.pool.get_data_page(0)
    assert a.backend.set(hashes[0], page) and a.backend.exists(hashes[0])
    out = a.backend.get(hashes[0], a.pool.get_dummy_flat_data_page())
    assert out is not None and torch.equal(out, page)
    with pytest.raises(ConfigError):
        a.backend.batch_get(hashes, None)
    with pytest.raises(ConfigError):
        a.backend.get(hashes[0])
    with pytest.raises(ConfigError):
        a.backend.set(hashes[0])


def test_hybrid_pools_v2(make_engine: Callable[..., Controller]) -> None:
    """A Mamba hybrid: KV pages by batch_set_v1, the Mamba state of the last
    page by batch_set_v2 (TRAILING_PAGES); batch_exists_v2 restores only
    prefixes whose trailing state exists; batch_get_v2 reads it back."""
    e = make_engine(MHAHostPool())
    mamba = MambaHostPool()
    e.backend.register_mem_host_pool_v2(e.pool, PoolName.KV)
    e.backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    e.backend.on_host_pools_registered()
    hashes = page_hashes(_tokens(4, seed=6), PAGE)
    fill_pages(e.pool, _slots([0, 1, 2, 3]), seed=6)
    mamba.fill(2, seed=61)
    mamba.fill(3, seed=62)
    assert e.backup(hashes, [0, 1, 2, 3]) == 4 * PAGE
    res = e.backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=[hashes[1]],
                                               host_indices=torch.tensor([2]),
                                               hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert res == {"mamba": [True]}
    query = PoolTransfer(name=PoolName.MAMBA, keys=[hashes[-1]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = e.backend.batch_exists_v2(hashes, [query])
    assert hit.kv_hit_pages == 2 and hit.restorable_prefix_pages == [2]
    assert hit.extra_pool_hit_pages == {"kv": 4, "mamba": 2}
    # SGLang asks for KV pages with an ALL_PAGES side pool too
    all_pages = PoolTransfer(name=PoolName.MAMBA, keys=hashes)
    assert e.backend.batch_exists_v2(hashes, [all_pages]).kv_hit_pages == 0
    got = e.backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=[hashes[1], hashes[3]],
                                               host_indices=torch.tensor([5, 6]))])
    assert got == {"mamba": [True, False]}
    for want, have in zip(mamba.slot(2), mamba.slot(5), strict=True):
        assert torch.equal(want, have)
    # a KV transfer in v2 uses the v1 objects
    kv = e.backend.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=hashes[:2],
                                              host_indices=_slots([10, 11]))])
    assert kv == {"kv": [True, True]}
    assert torch.equal(e.pool.page(11 * PAGE), e.pool.page(1 * PAGE))
    with pytest.raises(ConfigError):
        e.backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=hashes[:1],
                                             host_indices=_slots([0]))])


def test_mla_hybrid_mamba_state_is_per_rank(make_engine: Callable[..., Controller]) -> None:
    """MLA + Mamba: rank 1 writes its own Mamba state (TP-sharded) but no KV."""
    r1 = make_engine(MLAHostPool(), tp_rank=1, tp_size=2, mla=True)
    mamba = MambaHostPool()
    r1.backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    h = page_hashes(_tokens(1, seed=7), PAGE)
    mamba.fill(0, seed=7)
    out = r1.backend.batch_set_v2([
        PoolTransfer(name=PoolName.KV, keys=h, host_indices=_slots([0])),
        PoolTransfer(name=PoolName.MAMBA, keys=h, host_indices=torch.tensor([0]))])
    assert out == {"kv": [True], "mamba": [True]}
    assert r1.backend.batch_exists(h) == 0
    key = r1.backend._pool_keys(PoolName.MAMBA, h)[0]
    assert "/tp1of2/mamba/" in key and r1.backend.client.exists(key)


def test_clear_removes_this_models_pages_only(make_engine: Callable[..., Controller]) -> None:
    a = make_engine(MHAHostPool())
    other = make_engine(MHAHostPool(), model=f"org/other-{uuid.uuid4().hex[:6]}")
    hashes = page_hashes(_tokens(2, seed=8), PAGE)
    for e in (a, other):
        fill_pages(e.pool, _slots([0, 1]), seed=8)
        assert e.backup(hashes, [0, 1]) == 2 * PAGE
    a.backend.clear()
    assert a.backend.batch_exists(hashes) == 0
    assert a.backend.get_stats() is None  # no enable_storage_metrics
    assert other.backend.batch_exists(hashes) == 2


def test_store_failures_are_misses(make_engine: Callable[..., Controller]) -> None:
    """A client that can no longer reach the store (closed here) makes every call
    answer "nothing" (SGLang treats any storage failure as a miss)."""
    e = make_engine(MHAHostPool())
    hashes = page_hashes(_tokens(2, seed=11), PAGE)
    fill_pages(e.pool, _slots([0, 1]), seed=11)
    assert e.backup(hashes, [0, 1]) == 2 * PAGE
    e.backend.client.close()
    assert e.backend.batch_exists(hashes) == 0
    assert e.backend.batch_get_v1(hashes, _slots([2, 3])) == [False, False]
    assert e.backend.batch_set_v1(hashes, _slots([0, 1])) == [False, False]
    assert e.pool.page(2 * PAGE).abs().sum() == 0


def test_bad_config_is_a_typed_error(master: MasterProcess) -> None:
    cfg = storage_config(extra={"master_address": master.address})
    cfg.should_split_heads = True
    with pytest.raises(ConfigError):
        KVPoolHiCacheStorage(cfg, {})


def test_pinned_contract_matches_sglang() -> None:
    """Where SGLang imports: the backend subclasses SGLang's HiCacheStorage (its
    factory checks), implements every abstract method, and the pinned stand-ins
    have SGLang's signatures; SGLang's own factory builds the backend class."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache import hicache_storage as real

    assert sglang.SGLANG_IMPORTED and issubclass(KVPoolHiCacheStorage, real.HiCacheStorage)
    assert not getattr(KVPoolHiCacheStorage, "__abstractmethods__", None)
    for name in ("get", "batch_get", "set", "batch_set", "exists", "batch_exists",
                 "batch_get_v1", "batch_set_v1", "batch_exists_v2", "batch_get_v2",
                 "batch_set_v2", "register_mem_pool_host", "register_mem_host_pool_v2", "clear"):
        want = list(inspect.signature(getattr(real.HiCacheStorage, name)).parameters)
        assert list(inspect.signature(getattr(_sglang_api.HiCacheStorage, name)).parameters) \
            == want, name
        assert list(inspect.signature(getattr(KVPoolHiCacheStorage, name)).parameters) \
            == want, name
    for cls in ("HiCacheStorageConfig", "HiCacheStorageExtraInfo", "PoolTransfer",
                "PoolTransferResult"):
        fields = list(getattr(real, cls).__dataclass_fields__)
        assert list(getattr(_sglang_api, cls).__dataclass_fields__) == fields, cls


def test_sglang_factory_builds_the_backend(master: MasterProcess, daemon: NodeDaemonProcess
                                           ) -> None:
    """SGLang's own StorageBackendFactory ("dynamic") makes the backend and it
    serves SGLang's own config dataclass."""
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = MHAHostPool()
    cfg = storage_config(model=f"org/f-{uuid.uuid4().hex[:6]}", extra={
        "backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
        "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
        "master_address": master.address})
    cfg.enable_storage_metrics = True
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    try:
        backend.register_mem_pool_host(pool)
        hashes = page_hashes(_tokens(2, seed=9), PAGE)
        fill_pages(pool, _slots([0, 1]), seed=9)
        assert backend.batch_set_v1(hashes, _slots([0, 1])) == [True, True]
        assert backend.batch_exists(hashes) == 2
        assert backend.batch_get_v1(hashes, _slots([2, 3])) == [True, True]
        assert torch.equal(pool.page(3 * PAGE), pool.page(1 * PAGE))
        stats = backend.get_stats()
        assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
        assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
        assert backend.get_stats().backup_pgs == []  # taken
    finally:
        backend.close()


@pytest.mark.parametrize("interface_v1", [1, 0])
@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mha", "layer_first"),
                                         ("mla", "page_first"), ("mla", "layer_first")])
def test_sglang_own_host_pools(make_engine: Callable[..., Controller], kind: str,
                               layout: str, interface_v1: int) -> None:
    """Where SGLang imports: its own host pool classes. The replicas these tests
    use give the same page addresses (relative to the buffer), and pages move
    between two real pools byte for byte."""
    pytest.importorskip("sglang.srt.mem_cache.pool_host.mha")
    a_pool = real_sglang_pool(kind, layout)
    replica = MHAHostPool(layout=layout, pages=a_pool.size // PAGE) if kind == "mha" \
        else MLAHostPool(layout=layout, pages=a_pool.size // PAGE)
    idx = _slots([2, 0, 5])
    real_ptrs, real_sizes = a_pool.get_page_buffer_meta(idx)
    rep_ptrs, rep_sizes = replica.get_page_buffer_meta(idx)
    assert real_sizes == rep_sizes
    assert [p - a_pool.kv_buffer.data_ptr() for p in real_ptrs] == \
        [p - replica.kv_buffer.data_ptr() for p in rep_ptrs]
    mla = kind == "mla"
    a = make_engine(a_pool, interface_v1, mla=mla)
    b = make_engine(real_sglang_pool(kind, layout), interface_v1, mla=mla)
    a_pool.kv_buffer.copy_(torch.randn(a_pool.kv_buffer.shape).to(a_pool.kv_buffer.dtype))
    hashes = page_hashes(_tokens(3, seed=10), PAGE)
    assert a.backup(hashes, [0, 1, 2]) == 3 * PAGE
    assert b.hit_query(hashes) == hashes
    assert b.transfer(hashes, [4, 6, 5]) == 3
    for s, d in zip([0, 1, 2], [4, 6, 5], strict=True):
        assert torch.equal(b.pool.get_data_page(d * PAGE).view(torch.int16),
                           a_pool.get_data_page(s * PAGE).view(torch.int16))


def test_sglang_own_mamba_pool_v2(make_engine: Callable[..., Controller]) -> None:
    """Where SGLang imports: a hybrid engine with SGLang's own MHA and Mamba host
    pools; a second engine restores the prefix with its trailing state."""
    pytest.importorskip("sglang.srt.mem_cache.pool_host.mamba")
    engines = []
    for _ in range(2):
        e = make_engine(real_sglang_pool("mha", "page_first"))
        m = real_sglang_mamba_pool()
        e.backend.register_mem_host_pool_v2(e.pool, PoolName.KV)
        e.backend.register_mem_host_pool_v2(m, PoolName.MAMBA)
        e.backend.on_host_pools_registered()
        engines.append((e, m))
    (a, am), (b, bm) = engines
    for buf in am.get_hybrid_pool_buffer():
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    a.pool.kv_buffer.copy_(torch.randn(a.pool.kv_buffer.shape).to(a.pool.kv_buffer.dtype))
    hashes = page_hashes(_tokens(3, seed=13), PAGE)
    assert a.backup(hashes, [0, 1, 2]) == 3 * PAGE
    trailing = PoolTransfer(name=PoolName.MAMBA, keys=[hashes[-1]], host_indices=torch.tensor([4]),
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert a.backend.batch_set_v2([trailing]) == {"mamba": [True]}
    hit = b.backend.batch_exists_v2(hashes, [PoolTransfer(
        name=PoolName.MAMBA, keys=[hashes[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert hit.kv_hit_pages == 3 and hit.restorable_prefix_pages == [3]
    assert b.transfer(hashes, [5, 6, 7]) == 3
    got = b.backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=[hashes[-1]],
                                               host_indices=torch.tensor([1]))])
    assert got == {"mamba": [True]}
    for src, dst in zip(am.get_hybrid_pool_buffer(), bm.get_hybrid_pool_buffer(), strict=True):
        assert torch.equal(dst[1].view(torch.uint8), src[4].view(torch.uint8))
    assert torch.equal(b.pool.get_data_page(7 * PAGE).view(torch.int16),
                       a.pool.get_data_page(2 * PAGE).view(torch.int16))
