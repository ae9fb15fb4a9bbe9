"""The call sequences of the engines that use Mooncake's store, replayed on kvpool.

Written from their source (the calls, arguments and result checks they make),
with host memory standing in for their KV caches; every byte read back is
compared with what was written:

- vLLM's MooncakeStoreConnector (``vllm/distributed/kv_transfer/kv_connector/
  v1/mooncake/store/worker.py``): positional setup with the node IP,
  ``register_buffer`` of each KV-cache region, dedup with ``batch_is_exist``,
  ``batch_put_from_multi_buffers`` of per-layer K/V block segments with a
  ReplicateConfig, ``batch_get_into_multi_buffers`` into other blocks of
  another instance, tier logging through ``batch_get_replica_desc``;
- SGLang HiCache's MooncakeStore (``python/sglang/srt/mem_cache/storage/
  mooncake_store/mooncake_store.py``): setup with the keyword arguments it
  passes (``tenant_id``, ``enable_ssd_offload``/``ssd_offload_path``, client
  HTTP), warmup, MHA pages (``_k``/``_v`` keys, ``batch_put_from`` /
  ``batch_get_into``), MLA layer-first pages (multi-buffer calls) with
  ``ReplicateConfig.group_ids``, standalone mode (``MooncakeHostMemAllocator``
  + ``setup_dummy`` beside a node daemon), ``remove_all``; it never calls
  ``close()``, so its store is dropped instead;
- LMCache's MooncakestoreConnector (``lmcache/v1/storage_backend/connector/
  mooncakestore_connector.py``): ``get_hostname`` as the preferred segment,
  ``put_parts(key, metadata, kv_bytes)`` + ``batch_get_buffer`` (its default
  ``save_chunk_meta=True``), ``put_from`` + ``batch_get_into``, ``is_exist``,
  unregister and close.
"""

from __future__ import annotations

import ctypes
import gc
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.protocol import SegmentKind
from kvpool.store.mooncake import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    d = tmp_path_factory.mktemp("engines-master")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=1000, client_ttl_s=3) as m:
        yield m


class KVCache:
    """A vLLM-style paged KV cache: per layer one region laid out
    (2 = K/V, num_blocks, block_bytes), i.e. K/V-first (FlashAttention)."""

    def __init__(self, layers: int, blocks: int, block_bytes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.regions = [rng.integers(0, 256, (2, blocks, block_bytes), dtype=np.uint8)
                        for _ in range(layers)]
        self.block_bytes = block_bytes

    def segments(self) -> list[int]:
        """Base address of every K and V segment (what vLLM's register_kv_caches keeps)."""
        return [int(r.ctypes.data) + kv * r.strides[0] for r in self.regions for kv in range(2)]

    def block(self, block_id: int) -> tuple[list[int], list[int]]:
        """vLLM's prepare_value: one address per segment, block_len each."""
        return ([base + block_id * self.block_bytes for base in self.segments()],
                [self.block_bytes] * len(self.segments()))

    def block_bytes_of(self, block_id: int) -> bytes:
        return b"".join(r[kv, block_id].tobytes() for r in self.regions for kv in range(2))


def vllm_setup(master: MasterProcess, ip: str) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    # MooncakeStoreConfig.from_file(...) then setup with the requester's IP
    ret = store.setup(ip, "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", master.address)
    assert ret == 0, "Initialize MooncakeDistributedStore failed."
    return store


def test_vllm_store_connector_save_and_load(master: MasterProcess) -> None:
    producer = vllm_setup(master, "127.0.0.1")
    consumer = vllm_setup(master, "127.0.0.2")  # another host id: bytes cross over tcp
    try:
        src = KVCache(layers=4, blocks=16, block_bytes=8192, seed=1)
        dst = KVCache(layers=4, blocks=16, block_bytes=8192, seed=2)
        for store, cache in ((producer, src), (consumer, dst)):
            for region in cache.regions:  # register_kv_caches: one call per storage
                assert store.register_buffer(int(region.ctypes.data), region.nbytes) == 0
        replicate_config = ReplicateConfig()
        replicate_config.preferred_segment = producer.get_hostname()
        keys = [f"llama@tp_rank:0@pcp0@dcp0@pp_rank:0@{h:016x}" for h in range(8)]
        # KVCacheStoreSendingThread: dedup, then one multi-buffer put of the missing blocks
        assert producer.batch_is_exist(keys) == [0] * 8
        addrs, sizes = zip(*(src.block(b) for b in range(8)), strict=True)
        res = producer.batch_put_from_multi_buffers(keys, list(addrs), list(sizes),
                                                    replicate_config)
        assert [i for i, v in enumerate(res) if v < 0] == []
        assert producer.batch_is_exist(keys) == [1] * 8
        assert producer.batch_put_from_multi_buffers(
            keys[:2], list(addrs[:2]), list(sizes[:2]), replicate_config) == [0, 0]
        # LookupKeyServer / scheduler: the consumer finds the prefix
        assert consumer.batch_is_exist([*keys, "llama@other"]) == [1] * 8 + [0]
        # KVCacheStoreRecvingThread: load into other blocks, rotated by tp_rank
        tiers = consumer.batch_get_replica_desc(keys)
        assert all(tiers[k][0].is_memory_replica() for k in keys)
        target_blocks = list(range(8, 16))
        addrs2, sizes2 = zip(*(dst.block(b) for b in target_blocks), strict=True)
        res = consumer.batch_get_into_multi_buffers(keys, list(addrs2), list(sizes2))
        assert res == [8 * 8192] * 8
        for i, b in enumerate(target_blocks):
            assert dst.block_bytes_of(b) == src.block_bytes_of(i)
    finally:
        producer.close()
        consumer.close()


def test_vllm_config_dict_with_string_sizes(master: MasterProcess) -> None:
    store = MooncakeDistributedStore()
    assert store.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": "64MB", "local_buffer_size": "64MB",
                        "protocol": "tcp", "device_name": "",
                        "master_server_address": master.address}) == 0
    try:
        assert store._c().config.memory_size == 64 << 20
        assert store.put("dict-sized", b"ok") == 0 and store.get("dict-sized") == b"ok"
    finally:
        store.remove("dict-sized", True)
        store.close()


def sglang_warmup(store: MooncakeDistributedStore) -> None:
    key, value = "sglang_mooncake_store_warmup_key" + "0" * 8, bytes(4 * 1024)
    assert store.put(key, value) == 0
    assert store.is_exist(key) == 1
    assert store.get(key) == value


def test_sglang_hicache_embedded_mha_and_mla(master: MasterProcess, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", str(16 << 20))
    store = MooncakeDistributedStore()
    setup_kwargs = {"enable_ssd_offload": True, "ssd_offload_path": str(tmp_path / "ssd"),
                    "tenant_id": "team-a"}
    ret_code = store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                           master.address, None, **setup_kwargs)
    assert ret_code == 0
    sglang_warmup(store)
    page, pages = 4096, 8
    host_kv = np.random.default_rng(3).integers(0, 256, (2, pages, page), dtype=np.uint8)
    assert store.register_buffer(int(host_kv.ctypes.data), host_kv.nbytes) == 0
    # MHA page_first: keys "<hash>_<rank>_k"/"_v", one buffer each (batch_set_v1)
    keys = [f"p{i}_0_{kv}" for i in range(pages) for kv in ("k", "v")]
    ptrs = [int(host_kv[kv, i].ctypes.data) for i in range(pages) for kv in range(2)]
    sizes = [page] * len(keys)
    exist = store.batch_is_exist(keys)
    missing = [i for i, e in enumerate(exist) if e != 1]
    res = store.batch_put_from([keys[i] for i in missing], [ptrs[i] for i in missing],
                               [sizes[i] for i in missing])
    assert all(r == 0 for r in res)
    back = np.zeros_like(host_kv)
    assert store.register_buffer(int(back.ctypes.data), back.nbytes) == 0
    res = store.batch_get_into(keys, [int(back[kv, i].ctypes.data) for i in range(pages)
                                      for kv in range(2)], sizes)
    assert all(r > 0 for r in res) and np.array_equal(back, host_kv)
    # MLA layer_first: one key per page, one buffer per layer, grouped per logical page
    layers = 3
    mla = np.random.default_rng(4).integers(0, 256, (layers, pages, 1024), dtype=np.uint8)
    assert store.register_buffer(int(mla.ctypes.data), mla.nbytes) == 0
    mla_keys = [f"p{i}__k" for i in range(pages)]
    mla_ptrs = [[int(mla[layer, i].ctypes.data) for layer in range(layers)]
                for i in range(pages)]
    cfg = ReplicateConfig()
    cfg.group_ids = [f"sglang-hicache:p{i}" for i in range(pages)]
    assert store.batch_put_from_multi_buffers(mla_keys, mla_ptrs, [[1024] * layers] * pages,
                                              cfg) == [0] * pages
    out = np.zeros_like(mla)
    assert store.batch_get_into_multi_buffers(
        mla_keys, [[int(out[layer, i].ctypes.data) for layer in range(layers)]
                   for i in range(pages)], [[1024] * layers] * pages) == [3 * 1024] * pages
    assert np.array_equal(out, mla)
    # the SSD offload it asked for is there (this store's own disk tier)
    segs = store._c().list_segments()
    assert any(s.descriptor.kind == SegmentKind.FILE
               and s.descriptor.segment_id in store._c().segment_ids for s in segs)
    # another tenant does not see team-a's pages
    other = MooncakeDistributedStore()
    assert other.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address,
                       tenant_id="team-b") == 0
    assert other.batch_is_exist(keys[:2]) == [0, 0]
    other.close()
    # clear() -> remove_all: this tenant's objects only
    assert store.remove_all(True) == 1 + len(keys) + pages
    seg_ids = store._c().segment_ids
    # SGLang never calls close(): the dropped store unmounts its memory segment
    del store
    gc.collect()
    probe = MooncakeDistributedStore()
    assert probe.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                       master.address) == 0
    try:
        live = {s.descriptor.segment_id for s in probe._c().list_segments()
                if s.descriptor.kind == SegmentKind.MEMORY}
        assert seg_ids[0] not in live
    finally:
        probe.close()


def test_sglang_check_server_polls_get_all_segments(tmp_path: Path) -> None:
    import urllib.request

    from kvpool.cluster.processes import find_free_port

    port = find_free_port()
    with MasterProcess(data_dir=str(tmp_path), metrics_port=port) as m:
        url = f"http://{m.address.rsplit(':', 1)[0]}:{port}/get_all_segments"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read() == b""  # SGLang keeps waiting while the text is empty
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                           m.address) == 0
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.read().decode().splitlines() == [store.get_hostname()]
        finally:
            store.close()


def test_sglang_standalone_mode_beside_a_node_daemon(master: MasterProcess) -> None:
    port = free_port()
    with NodeDaemonProcess(master.address, "32MiB", extra_args=["--dummy-port", str(port)]):
        allocator = MooncakeHostMemAllocator()  # MooncakeHostTensorAllocator.allocate
        size = 8 * 4096
        ptr = allocator.alloc(size)
        assert ptr != 0
        c_array = (ctypes.c_byte * size).from_address(ptr)
        pool = np.frombuffer(c_array, dtype=np.uint8)
        pool[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
        store = MooncakeDistributedStore()
        # the address of the node's client (the daemon's standalone port), as Mooncake
        assert store.setup_dummy(size, 16 << 20, f"127.0.0.1:{port}") == 0
        try:
            assert store.get_hostname()
            sglang_warmup(store)
            assert store.register_buffer(ptr, size) == 0
            keys = [f"sa{i}_0_k" for i in range(8)]
            assert store.batch_put_from(keys, [ptr + i * 4096 for i in range(8)],
                                        [4096] * 8) == [0] * 8
            back = np.zeros(size, np.uint8)
            assert store.batch_get_into(keys, [int(back.ctypes.data) + i * 4096
                                               for i in range(8)], [4096] * 8) == [4096] * 8
            assert np.array_equal(back, pool)
            # the bytes live in the daemon's segment, not in the engine process
            (desc,) = store.get_replica_desc(keys[0])
            assert desc.is_memory_replica()
            assert store._c().segment_ids == []
            assert store.remove_all() == 0  # clear(): every page is under a read lease
            time.sleep(1.2)
            assert store.remove_all() == 9  # 8 pages and the warmup key
        finally:
            store.close()
            del c_array, pool
            gc.collect()
            assert allocator.free(ptr) == 0
    # without a daemon on this host: Mooncake's -1 (the local client is not reachable)
    lonely = MooncakeDistributedStore()
    assert lonely.setup_dummy(size, 16 << 20, f"127.0.0.1:{port}") == -1


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a daemon's --dummy-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


METADATA_BYTES_LEN = 28


def lmcache_metadata(length: int, shape: tuple[int, int, int, int]) -> bytes:
    """LMCache's RemoteMetadata.serialize: 28 bytes (length, shape, dtype, fmt)."""
    return struct.pack("<iiiiiii", length, *shape, 7, 1)


def test_lmcache_connector_both_modes(master: MasterProcess) -> None:
    store = MooncakeDistributedStore()
    store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.address)
    replica_config = ReplicateConfig()
    replica_config.replica_num = 1
    replica_config.preferred_segment = store.get_hostname()  # prefer_local_alloc
    pinned = np.zeros(1 << 20, np.uint8)  # the local CPU backend's pinned buffer
    assert store.register_buffer(int(pinned.ctypes.data), pinned.size) == 0
    shape = (2, 4, 16, 64)
    chunk = np.random.default_rng(6).integers(0, 256, 2 * 4 * 16 * 64 * 2, dtype=np.uint8)
    # save_chunk_meta=True (default): put_parts(metadata, kv_bytes) / batch_get_buffer
    keys = [f"vllm@llama@1@0@{i:x}" for i in range(4)]
    for i, key in enumerate(keys):
        kv_bytes = memoryview(np.roll(chunk, i))
        assert store.put_parts(key, lmcache_metadata(len(kv_bytes), shape), kv_bytes) == 0
    buffers = store.batch_get_buffer([*keys, "vllm@llama@1@0@missing"])
    assert buffers[-1] is None
    for i, buffer in enumerate(buffers[:-1]):
        view = memoryview(buffer)
        meta = struct.unpack("<iiiiiii", view[:METADATA_BYTES_LEN])
        assert meta[0] == chunk.size and meta[1:5] == shape
        assert len(view) == meta[0] + METADATA_BYTES_LEN
        data = np.frombuffer(buffer, dtype=np.uint8, offset=METADATA_BYTES_LEN,
                             count=meta[0])
        assert np.array_equal(data, np.roll(chunk, i))
    # save_chunk_meta=False: put_from from the pinned buffer / batch_get_into
    pinned[:chunk.size] = chunk
    assert store.put_from("nometa", int(pinned.ctypes.data), chunk.size, replica_config) == 0
    assert store.is_exist("nometa")
    out = np.zeros(chunk.size, np.uint8)
    assert store.batch_get_into(["nometa"], [int(out.ctypes.data)], [out.size]) == [chunk.size]
    assert np.array_equal(out, chunk)
    assert store.get_replica_desc("nometa")[0].get_memory_descriptor() \
        .buffer_descriptor.transport_endpoint == store.get_hostname()
    # close(): unregister the CPU buffer, then close the store
    assert store.unregister_buffer(int(pinned.ctypes.data)) == 0
    assert store.close() == 0
