"""MooncakeDistributedStore: the behaviours Mooncake's own Python tests assert,
against a real master; each store here contributes its own segment."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.errors import ErrorCode
from kvpool.store import MooncakeDistributedStore, ReplicateConfig

LEASE_MS = 500
SEG = 16 * 1024 * 1024


@pytest.fixture
def fresh_master(tmp_path) -> Iterator[MasterProcess]:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path), lease_ttl_ms=LEASE_MS, client_ttl_s=3) as m:
        yield m


@pytest.fixture
def make_store(fresh_master: MasterProcess) -> Iterator[Callable[..., MooncakeDistributedStore]]:
    stores: list[MooncakeDistributedStore] = []

    def make(segment: int = SEG, protocol: str = "tcp") -> MooncakeDistributedStore:
        s = MooncakeDistributedStore()
        rc = s.setup("localhost", "P2PHANDSHAKE", segment, 16 * 1024 * 1024, protocol, "",
                     fresh_master.address)
        assert rc == 0
        stores.append(s)
        return s

    yield make
    for s in stores:
        assert s.close() == 0


def test_put_get_and_existing_key(make_store: Callable[..., MooncakeDistributedStore]) -> None:
    s = make_store()
    assert s.put("k", b"old value") == 0
    assert s.put("k", b"new value") == 0  # Mooncake: 0, and the old value stays
    assert s.get("k") == b"old value"
    assert s.get("missing") == b""
    assert s.get_size("k") == len(b"old value")
    assert s.get_size("missing") < 0
    assert s.health_check() == 0
    host, port = s.get_hostname().rsplit(":", 1)
    assert host == "localhost" and int(port) > 0


def test_batch_is_exist_order(make_store: Callable[..., MooncakeDistributedStore]) -> None:
    s = make_store()
    assert s.put_batch(["a", "c"], [b"1", b"3"]) == 0
    assert s.batch_is_exist(["c", "b", "a", "d"]) == [1, 0, 1, 0]
    assert s.batch_is_exist([]) == []
    assert s.is_exist("a") == 1 and s.is_exist("b") == 0
    assert s.get_batch(["a", "b", "c"]) == [b"1", b"", b"3"]
    assert s.put_batch(["x"], [b"1", b"2"]) < 0


def test_pointer_api(make_store: Callable[..., MooncakeDistributedStore]) -> None:
    s = make_store()
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 17, dtype=np.uint8)
    assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert s.put_from("p", src.ctypes.data, src.nbytes) == 0
    assert s.get_into("p", dst.ctypes.data, dst.nbytes) == src.nbytes
    assert np.array_equal(dst[: src.nbytes], src)
    # too small: negative, nothing read
    small = (ctypes.c_char * 100)()
    assert s.get_into("p", ctypes.addressof(small), 100) < 0
    assert s.get_into("missing", dst.ctypes.data, dst.nbytes) < 0
    # batches; mismatched lengths give a negative code per key
    ptrs = [src.ctypes.data, src.ctypes.data + 1000]
    assert s.batch_put_from(["q0", "q1"], ptrs, [1000, 2000]) == [0, 0]
    out = [dst.ctypes.data, dst.ctypes.data + 4096]
    assert s.batch_get_into(["q0", "q1"], out, [4096, 4096]) == [1000, 2000]
    assert np.array_equal(dst[:1000], src[:1000])
    assert np.array_equal(dst[4096:6096], src[1000:3000])
    bad = s.batch_get_into(["q0", "q1"], out, [4096])
    assert len(bad) == 2 and all(r < 0 for r in bad)
    bad = s.batch_put_from(["r0", "r1"], ptrs[:1], [10, 10])
    assert len(bad) == 2 and all(r < 0 for r in bad)
    assert s.unregister_buffer(src.ctypes.data) == 0
    assert s.unregister_buffer(src.ctypes.data) < 0  # not registered any more
    assert s.unregister_buffer(dst.ctypes.data) == 0


def test_remove_lease_and_force(make_store: Callable[..., MooncakeDistributedStore]) -> None:
    s = make_store()
    s.put("a", b"a")
    s.put("b", b"b")
    assert s.get("a") == b"a"  # read lease
    assert s.remove("a") == ErrorCode.OBJECT_HAS_LEASE
    time.sleep(LEASE_MS / 1000 + 0.3)
    assert s.remove("a") == 0
    assert s.is_exist("b") == 1  # lease again
    assert s.remove("b", True) == 0
    assert s.remove("b") == ErrorCode.OBJECT_NOT_FOUND
    for i in range(3):
        s.put(f"c{i}", b"c")
    assert s.remove_all(True) == 3
    assert s.remove_all() == 0


def test_two_replicas_with_one_segment_gives_one(
        make_store: Callable[..., MooncakeDistributedStore]) -> None:
    s = make_store()
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert s.put("k", b"v" * 100, cfg) == 0
    assert s.get("k") == b"v" * 100
    assert len(s._c().replica_segments("k")) == 1


def test_replicated_data_outlives_its_writer(
        make_store: Callable[..., MooncakeDistributedStore]) -> None:
    writer, reader = make_store(), make_store()
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert writer.put("two", b"2" * 5000, cfg) == 0
    cfg1 = ReplicateConfig()
    cfg1.preferred_segment = writer.get_hostname()
    assert writer.put("one", b"1" * 5000, cfg1) == 0
    assert reader._c().replica_segments("one") == [writer.get_hostname()]
    assert writer.close() == 0
    assert reader.get("two") == b"2" * 5000
    assert reader.get("one") == b""  # its only replica left with the writer
    assert reader.is_exist("one") == 0


def test_setup_with_config_dict_and_errors(fresh_master: MasterProcess) -> None:
    s = MooncakeDistributedStore()
    # Mooncake's dict form: string sizes with Mooncake's units (MB = MiB)
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "8MB", "local_buffer_size": "16 MB",
                    "protocol": "rdma", "master_server_address": fresh_master.address}) == 0
    try:
        assert s.put("d", b"dict") == 0 and s.get("d") == b"dict"
        assert s._c().config.memory_size == 8 << 20
    finally:
        assert s.close() == 0
    # Mooncake stages bytes calls through local_buffer_size: 0 makes them fail
    zero = MooncakeDistributedStore()
    assert zero.setup("localhost", "P2PHANDSHAKE", SEG, 0, "tcp", "", fresh_master.address) == 0
    try:
        assert zero.put("z", b"abc") == ErrorCode.INVALID_PARAMS
        assert zero.is_exist("z") == 0
    finally:
        zero.close()
    bad = MooncakeDistributedStore()
    assert bad.setup("localhost", "", SEG, SEG, "carrier-pigeon", "", fresh_master.address) < 0
    assert bad.setup({"local_hostname": "localhost"}) == ErrorCode.INVALID_PARAMS  # no metadata
    assert bad.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                      "global_segment_size": "50%"}) == ErrorCode.INVALID_PARAMS
    nowhere = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
               "global_segment_size": SEG, "protocol": "tcp",
               "master_server_address": f"127.0.0.1:{find_free_port()}", "rpc_timeout_s": 0.5}
    assert bad.setup(nowhere) in (ErrorCode.RPC_TIMEOUT, ErrorCode.RPC_FAIL)
    assert bad.health_check() == 1  # not initialized
    assert bad.get("x") == b"" and bad.put("x", b"y") < 0 and bad.is_exist("x") == -1
