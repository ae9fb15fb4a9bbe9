"""kvpool.store.mooncake against Mooncake's documented behaviour, call by call.

Each test follows Mooncake's API reference (docs/source/api-reference/python/
mooncake-store.md) or a result observed on Mooncake 0.3.13.post1 itself; the
expected values are Mooncake's. Every store is real (a real master, real
segments), every read compared byte for byte.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mooncake_reference import MOONCAKE_0313_MODULE_NAMES, MOONCAKE_0313_SIGNATURES

import kvpool.store.mooncake as mc
from kvpool.cluster.processes import MasterProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.store.mooncake import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from kvpool.store.mooncake_async import MooncakeDistributedStoreAsync

pytestmark = pytest.mark.timeout(120)

LEASE_MS = 500
SEG = 16 << 20
INVALID = int(ErrorCode.INVALID_PARAMS)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    d = tmp_path_factory.mktemp("mc-master")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=LEASE_MS, client_ttl_s=3) as m:
        yield m


@pytest.fixture
def make_store(master: MasterProcess) -> Iterator[Callable[..., MooncakeDistributedStore]]:
    made: list[MooncakeDistributedStore] = []

    def make(segment: int = SEG, local_buffer: int = 16 << 20, cls: type = MooncakeDistributedStore,
             **kw: object) -> MooncakeDistributedStore:
        s = cls()
        assert s.setup("localhost", "P2PHANDSHAKE", segment, local_buffer, "tcp", "",
                       master.address, **kw) == 0
        made.append(s)
        return s

    yield make
    for s in made:
        s.remove_all(True) if s._client is not None else None
        assert s.close() == 0


@pytest.fixture
def store(make_store: Callable[..., MooncakeDistributedStore]) -> MooncakeDistributedStore:
    return make_store()


def arr(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Counting:
    """Counts the master RPCs and transfer batches a store's client makes."""

    def __init__(self, store: MooncakeDistributedStore) -> None:
        self.client = store._c()
        self.rpcs = self.batches = 0
        self.ops: list[str] = []

    def __enter__(self) -> Counting:
        session, engine = self.client._parts.session, self.client.engine
        call, run, transfer = session.call, engine.run, engine.transfer

        def counted_call(request: object) -> object:
            self.rpcs += 1
            self.ops.append(type(request).__name__)
            return call(request)  # type: ignore[arg-type]

        def counted(fn: Any) -> Any:
            def batch(*a: object, **k: object) -> object:
                self.batches += 1
                return fn(*a, **k)
            return batch

        session.call = counted_call  # type: ignore[method-assign]
        engine.run, engine.transfer = counted(run), counted(transfer)
        return self

    def __exit__(self, *exc: object) -> None:
        engine = self.client.engine
        del self.client._parts.session.call, engine.run, engine.transfer


# ---------------------------------------------------------------------- the surface


def test_every_method_and_module_name_of_mooncake_exists_with_its_signature() -> None:
    for name in MOONCAKE_0313_MODULE_NAMES:
        assert hasattr(mc, name), f"kvpool.store.mooncake lacks {name}"
    ours = MooncakeDistributedStore
    for name, overloads in MOONCAKE_0313_SIGNATURES.items():
        method = getattr(ours, name, None)
        assert callable(method), f"MooncakeDistributedStore lacks {name}"
        params = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
        sig = overloads[0]  # the positional overload (setup: its dict form is checked below)
        for i, (pname, default) in enumerate(sig):
            if pname == "*args":
                assert any(p.kind is p.VAR_POSITIONAL for p in params), name
                continue
            p = next((q for q in params if q.name == pname), None) \
                if not pname.startswith("arg") else params[i]
            assert p is not None, f"{name}: no parameter {pname!r}"
            if not pname.startswith("arg") and p.kind is not p.KEYWORD_ONLY:
                assert params.index(p) == i, f"{name}: {pname} is not parameter {i}"
            if default is None:
                continue
            if default == "CONFIG":
                assert p.default is None, f"{name}.{pname}: default config"
            else:
                assert repr(p.default) == default, f"{name}.{pname} = {p.default!r}, not {default}"
    # Mooncake's pybind11 enums print as Name.MEMBER
    assert str(mc.ReplicaStatus.COMPLETE) == "ReplicaStatus.COMPLETE"
    assert mc.PROCESSING is mc.TaskStatus.PROCESSING and int(mc.TaskStatus.SUCCESS) == 3
    assert [int(a) for a in SoftPinAction] == [0, 1, 2]


def test_replicate_config_fields_and_soft_pin_ttl_typing() -> None:
    cfg = ReplicateConfig()
    assert (cfg.replica_num, cfg.with_hard_pin, cfg.with_soft_pin, cfg.preferred_segment,
            cfg.preferred_segments, cfg.nof_replica_num, cfg.dfs_replica_num,
            cfg.soft_pin_action, cfg.soft_pin_ttl_ms, cfg.prefer_alloc_in_same_node,
            cfg.group_ids) == (1, False, False, "", [], 0, 0, SoftPinAction.PRESERVE, None,
                               False, None)
    cfg.soft_pin_ttl_ms = 1000
    assert cfg.soft_pin_ttl_ms == 1000
    cfg.soft_pin_ttl_ms = None
    for bad in (-1, 1 << 64, "10"):
        with pytest.raises(TypeError):
            cfg.soft_pin_ttl_ms = bad  # type: ignore[assignment]
    cfg.soft_pin_action = SoftPinAction.ENABLE
    assert cfg.to_args()["soft_pin"] is True
    cfg.nof_replica_num = 1
    assert cfg.to_args()["disk_replica_num"] == 1  # kvpool's disk tier serves NoF replicas


# ---------------------------------------------------------------------- lifecycle


def test_hostname_health_close_and_setup_again(master: MasterProcess) -> None:
    s = MooncakeDistributedStore()
    assert s.health_check() == 1 and s.get_hostname() == ""
    assert s.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "", master.address) == 0
    host, port = s.get_hostname().split(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300  # Mooncake's port range
    assert s.health_check() == 0
    assert s.put("gone", b"with the segment") == 0
    assert s.init_all("tcp", "", SEG) == INVALID  # already initialized
    assert s.close() == 0 and s.close() == 0
    assert s.health_check() == 1
    assert s.put("x", b"1") == INVALID and s.get("x") == b"" and s.is_exist("x") == -1
    assert s.setup(config={"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                           "master_server_addr": master.address}) == 0
    try:
        assert s.get("gone") == b""  # its only replica left with the first segment
        assert s.put("back", b"again") == 0 and s.get("back") == b"again"
    finally:
        s.remove("back", True)
        s.close()


def test_setup_on_a_taken_port_returns_a_code(master: MasterProcess) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        s = MooncakeDistributedStore()
        assert s.setup(f"127.0.0.1:{port}", "P2PHANDSHAKE", SEG, SEG, "tcp", "",
                       master.address) == -1  # Mooncake's failed setup; never an exception
        assert s.health_check() == 1


def test_unknown_protocol_fails_foreign_protocol_falls_back(master: MasterProcess) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "bogus", "", master.address) == -1
    assert s.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "cxl", "", master.address) == 0
    try:
        assert s.put("cxl", b"over tcp") == 0 and s.get("cxl") == b"over tcp"
    finally:
        s.remove("cxl", True)
        s.close()


# ---------------------------------------------------------------------- bytes


def test_bytes_calls_return_mooncakes_codes(store: MooncakeDistributedStore) -> None:
    assert store.put("k1", b"hello") == 0
    assert store.put("k1", b"other") == 0 and store.get("k1") == b"hello"  # value kept
    assert store.put("", b"x") == INVALID and store.put("e", b"") == INVALID
    assert store.get("nope") == b"" and store.get_size("nope") == NOT_FOUND
    assert store.is_exist("") == 0 and store.batch_is_exist(["k1", "nope", ""]) == [1, 0, 0]
    assert store.put_batch(["a"], [b"1", b"2"]) == INVALID
    assert store.put_batch(["b1", "b2"], [b"11", b"222"]) == 0
    assert store.put_batch(["b3", "b3"], [b"1", b"2"]) == 0
    assert store.get_batch(["b1", "nope", "b2"]) == [b"11", b"", b"222"]
    assert store.put_parts("pp", b"ab", bytearray(b"cde"), memoryview(b"fg")) == 0
    assert store.get("pp") == b"abcdefg"
    with pytest.raises(RuntimeError, match="1-D bytes-like"):
        store.put_parts("bad", np.zeros((2, 2), np.uint8))


def test_buffer_handles_support_the_buffer_protocol(store: MooncakeDistributedStore) -> None:
    data = arr(5000, 1)
    assert store.put("big", data.tobytes()) == 0
    h = store.get_buffer("big")
    assert h is not None and h.size() == len(h) == 5000 and h.ptr() != 0
    assert bytes(memoryview(h)) == data.tobytes()
    assert np.array_equal(np.frombuffer(h, dtype=np.uint8), data)
    assert store.get_buffer("nope") is None
    hs = store.batch_get_buffer(["big", "nope"])
    assert hs[1] is None and hs[0] is not None and bytes(hs[0]) == data.tobytes()


def test_local_buffer_size_bounds_the_staged_calls(
        make_store: Callable[..., MooncakeDistributedStore]) -> None:
    small = make_store(local_buffer=1 << 20)
    assert small.put("two_mib", bytes(2 << 20)) == INVALID
    assert small.put_parts("two_mib", bytes(1 << 20), bytes(1 << 20)) == INVALID
    src = arr(2 << 20, 2)
    assert small.put_from("zc", src.ctypes.data, src.nbytes) == 0  # zero-copy: no staging
    assert small.get("zc") == b""  # staged read larger than the buffer
    dst = np.zeros(2 << 20, np.uint8)
    assert small.get_into("zc", dst.ctypes.data, dst.nbytes) == 2 << 20
    assert np.array_equal(dst, src)


def test_upsert_inserts_and_replaces(store: MooncakeDistributedStore) -> None:
    assert store.upsert("u", b"v1") == 0 and store.get("u") == b"v1"
    assert store.upsert("u", b"v2") == 0 and store.get("u") == b"v2"  # same size
    # the get above holds a read lease: the upsert does not wait for it
    t0 = time.monotonic()
    assert store.upsert("u", b"a longer value") == 0 and store.get("u") == b"a longer value"
    assert time.monotonic() - t0 < LEASE_MS / 1000
    assert store.upsert_parts("up", b"Hello, ", b"World!") == 0
    assert store.get("up") == b"Hello, World!"
    assert store.upsert_batch(["u", "ub"], [b"x", b"y"]) == 0
    assert store.get_batch(["u", "ub"]) == [b"x", b"y"]
    src = arr(64, 3)
    assert store.upsert_from("uf", src.ctypes.data, 8) == 0
    assert store.batch_upsert_from(["uf", "ug"], [src.ctypes.data + 8] * 2, [4, 4]) == [0, 0]
    assert store.get("uf") == src[8:12].tobytes() and store.get("ug") == src[8:12].tobytes()
    # Mooncake: a soft-pin TTL needs SoftPinAction.ENABLE
    cfg = ReplicateConfig()
    cfg.soft_pin_ttl_ms = 1000
    assert store.upsert("u", b"t", cfg) == INVALID
    cfg.soft_pin_action = SoftPinAction.DISABLE
    assert store.upsert("u", b"t", cfg) == INVALID
    cfg.soft_pin_action = SoftPinAction.ENABLE
    assert store.put("sp", b"pinned", cfg) == 0


def test_remove_family(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["r1", "r2", "r3"], [b"1", b"2", b"3"]) == 0
    assert store.get("r1") == b"1"  # read lease
    assert store.batch_remove(["r1", "r2", "nope"]) == [
        int(ErrorCode.OBJECT_HAS_LEASE), 0, NOT_FOUND]
    assert store.remove("r1") == int(ErrorCode.OBJECT_HAS_LEASE)
    assert store.remove("r1", True) == 0 and store.remove("r1") == NOT_FOUND
    assert store.put_batch(["user_session_1", "user_session_2", "keep_me"], [b"a", b"b", b"c"]) == 0
    assert store.remove_by_regex("^user_session_.*") == 2  # the API reference's example
    assert store.batch_is_exist(["user_session_1", "user_session_2", "keep_me"]) == [0, 0, 1]
    assert store.remove_by_regex("[") == INVALID  # a pattern that does not compile
    assert store.is_exist("keep_me") == 1  # read lease
    assert store.remove_by_regex("keep") == 0 and store.remove_by_regex("keep", True) == 1
    assert store.remove_all(True) >= 1 and store.is_exist("r3") == 0


def test_tenants_do_not_see_each_others_keys(
        make_store: Callable[..., MooncakeDistributedStore]) -> None:
    a = make_store(tenant_id="tenant-a")
    b = make_store(tenant_id="tenant-b")
    d = make_store()
    assert a.put("shared", b"from a") == 0 and b.put("shared", b"from b") == 0
    assert a.get("shared") == b"from a" and b.get("shared") == b"from b"
    assert d.get("shared") == b"" and d.is_exist("shared") == 0
    assert d.put("shared", b"default") == 0 and a.get("shared") == b"from a"
    assert a.batch_is_exist(["shared", "other"]) == [1, 0]
    assert a.put("\x1ftenant-b\x1fshared", b"x") == INVALID  # no escaping the namespace
    # remove_all and remove_by_regex stay inside the caller's tenant
    assert a.put("a-only", b"1") == 0 and d.put("d-only", b"2") == 0
    assert b.remove_all(True) == 1
    assert (a.get("shared"), b.get("shared"), d.get("shared")) == (b"from a", b"", b"default")
    assert d.remove_by_regex("only$", True) == 1 and a.is_exist("a-only") == 1
    assert d.remove_all(True) == 1 and a.batch_is_exist(["shared", "a-only"]) == [1, 1]
    assert a.remove_all(True) == 2


# ---------------------------------------------------------------------- zero copy


def test_pointer_calls(store: MooncakeDistributedStore) -> None:
    src, dst = arr(1000, 4), np.zeros(4096, np.uint8)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert store.unregister_buffer(12345) == INVALID
    assert store.put_from("pf", src.ctypes.data, src.nbytes) == 0
    assert store.put_from("zero", src.ctypes.data, 0) == 0 and store.is_exist("zero") == 0
    assert store.get_into("pf", dst.ctypes.data, dst.nbytes) == 1000
    assert np.array_equal(dst[:1000], src)
    assert store.get_into("pf", dst.ctypes.data, 10) == INVALID  # too small: nothing read
    assert store.get_into("nope", dst.ctypes.data, 100) == NOT_FOUND
    assert store.batch_put_from(["x1", "x2"], [src.ctypes.data], [10]) == [INVALID, INVALID]
    assert store.batch_put_from(["z1"], [src.ctypes.data], [0]) == [INVALID]
    assert store.batch_get_into(["pf", "x"], [dst.ctypes.data], [10]) == [INVALID, INVALID]
    assert store.batch_get_into(["pf", "nope"], [dst.ctypes.data, dst.ctypes.data + 2000],
                                [2000, 100]) == [1000, NOT_FOUND]
    assert store.batch_get_into([], [], []) == [] and store.batch_put_from([], [], []) == []
    meta, data = np.frombuffer(b"META", np.uint8).copy(), np.frombuffer(b"DATA!", np.uint8).copy()
    assert store.put_from_with_metadata("wm", data.ctypes.data, meta.ctypes.data, 5, 4) == 0
    assert store.get("wm") == b"METADATA!"  # metadata first
    assert store.unregister_buffer(src.ctypes.data) == 0
    assert store.unregister_buffer(src.ctypes.data) == INVALID


def test_multi_buffers_concatenate_and_scatter(store: MooncakeDistributedStore) -> None:
    a = arr(64, 5)
    b = np.zeros(64, np.uint8)
    assert store.register_buffer(a.ctypes.data, 64) == 0 and store.register_buffer(b.ctypes.data,
                                                                                   64) == 0
    base = a.ctypes.data
    assert store.batch_put_from_multi_buffers(["m1", "m2"], [[base, base + 10], [base + 20]],
                                              [[10, 5], [7]]) == [0, 0]
    assert store.get("m1") == a[:15].tobytes() and store.get("m2") == a[20:27].tobytes()
    # existing keys: 0 (value kept); 0 bytes: -600; mismatched lengths: -600 for every key
    assert store.batch_put_from_multi_buffers(["m1"], [[base]], [[3]]) == [0]
    assert store.batch_put_from_multi_buffers(["m6"], [[base]], [[0]]) == [INVALID]
    assert store.batch_put_from_multi_buffers(["m8", "m9"], [[base]], [[4]]) == [INVALID] * 2
    out = b.ctypes.data
    assert store.batch_get_into_multi_buffers(["m1", "m2", "nope"],
                                              [[out, out + 32], [out + 48], [out]],
                                              [[8, 7], [7], [4]]) == [15, 7, NOT_FOUND]
    assert b[:8].tobytes() + b[32:39].tobytes() == a[:15].tobytes()
    assert b[48:55].tobytes() == a[20:27].tobytes()
    assert store.batch_get_into_multi_buffers(["m1"], [[out]], [[4]]) == [INVALID]  # too small
    assert store.batch_get_into_multi_buffers(["m1", "m2"], [[out]], [[4]]) == [INVALID] * 2


def _holder_and_client(master: MasterProcess, tcp: bool) -> list[MooncakeDistributedStore]:
    """A store holding memory and a pure client; ``tcp``: every transfer over
    tcp (the transfer servers), else the default rules (shared memory here)."""
    force = {"transfer_overrides": {"rules": [{"name": "all-tcp", "transports": ["tcp"]}]}}
    stores = []
    for seg in (SEG, 0):
        s = MooncakeDistributedStore()
        assert s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": seg, "master_server_addr": master.address,
                        **(force if tcp else {})}) == 0
        stores.append(s)
    return stores


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_multi_buffer_calls_cost_one_rpc_and_one_transfer_batch_each(
        master: MasterProcess, path: str) -> None:
    stores = _holder_and_client(master, tcp=path == "tcp")
    writer, reader = stores
    try:
        keys = [f"mb-{path}-{i}" for i in range(32)]
        src = [[arr(4096, i * 8 + j) for j in range(8)] for i in range(32)]
        dst = [[np.zeros(4096, np.uint8) for _ in range(8)] for _ in range(32)]
        with Counting(writer) as w:
            assert writer.batch_put_from_multi_buffers(
                keys, [[int(b.ctypes.data) for b in bs] for bs in src],
                [[4096] * 8 for _ in keys]) == [0] * 32
        assert w.ops == ["BatchPutStart", "BatchPutEnd"]
        # the parts of each object gathered into one range: one transfer batch
        assert w.batches == 1
        with Counting(reader) as r:
            assert reader.batch_get_into_multi_buffers(
                keys, [[int(b.ctypes.data) for b in bs] for bs in dst],
                [[4096] * 8 for _ in keys]) == [8 * 4096] * 32
        assert r.ops == ["BatchGetReplicaList"] and r.batches == 1
        for i in range(32):
            for j in range(8):
                assert np.array_equal(dst[i][j], src[i][j])
        assert writer.batch_remove(keys, True) == [0] * 32
    finally:
        for s in stores:
            s.close()


def test_get_into_ranges_is_buffer_major_and_fragment_exact(
        store: MooncakeDistributedStore) -> None:
    key1, key2 = arr(40, 6), arr(40, 7)
    assert store.put("key1", key1.tobytes()) == 0 and store.put("key2", key2.tobytes()) == 0
    b0, b1 = (ctypes.c_ubyte * 32)(), (ctypes.c_ubyte * 32)()
    p0, p1 = ctypes.addressof(b0), ctypes.addressof(b1)
    assert store.register_buffer(p0, 32) == 0 and store.register_buffer(p1, 32) == 0
    # the API reference's example, with its documented result
    res = store.get_into_ranges([p0, p1], [["key1", "key2"], ["key2", "key1"]],
                                [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]],
                                [[[4, 3], [5]], [[6], [4]]])
    assert res == [[[4, 3], [5]], [[6], [4]]]
    assert bytes(b0[0:4]) == key1[1:5].tobytes() and bytes(b0[20:23]) == key1[30:33].tobytes()
    assert bytes(b0[8:13]) == key2[2:7].tobytes()
    assert bytes(b1[4:10]) == key2[0:6].tobytes() and bytes(b1[16:20]) == key1[10:14].tobytes()
    # a missing key fails alone; ranges outside the object or buffer; bad shapes
    assert store.get_into_ranges([p0], [["key1", "nope"]], [[[0], [8]]], [[[0], [0]]],
                                 [[[2], [2]]]) == [[[2], [NOT_FOUND]]]
    assert store.get_into_ranges([p0], [["key1"]], [[[0]]], [[[39]]], [[[4]]]) == [[[INVALID]]]
    assert store.get_into_ranges([p0], [["key1"]], [[[30]]], [[[0]]], [[[4]]]) == [[[INVALID]]]
    assert store.get_into_ranges([p0], [["key1"]], [[[0]]], [[[0, 1]]], [[[4]]]) == [[[INVALID]]]
    unregistered = (ctypes.c_ubyte * 8)()
    assert store.get_into_ranges([ctypes.addressof(unregistered)], [["key1"]], [[[0]]], [[[0]]],
                                 [[[4]]]) == [[[INVALID]]]


def test_sessions_put_and_get_ranges_without_master_rpcs(
        store: MooncakeDistributedStore) -> None:
    page, layers, keys = 1024, 4, ["block0", "block1"]
    src = [np.full(page, i + 1, dtype=np.uint8) for i in range(layers)]
    dst = [np.zeros(page, dtype=np.uint8) for _ in range(layers)]
    for buf in src + dst:
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert store.batch_put_session_start(keys, [page * layers] * 2) == [0, 0]
    assert store.batch_put_session_start(keys[:1], [page]) == [INVALID]  # already open
    with Counting(store) as count:
        for layer in range(layers):
            rcs = store.batch_put_from_multi_buffer_ranges(
                keys, [[src[layer].ctypes.data]] * 2, [[page]] * 2, [[layer * page]] * 2)
            assert rcs == [page, page]
    assert count.rpcs == 0 and count.batches == layers  # ranges: no master RPC
    assert store.batch_put_from_multi_buffer_ranges(keys[:1], [[src[0].ctypes.data]], [[page]],
                                                    [[layers * page]]) == [INVALID]
    assert store.get("block0") == b""  # not readable before the session ends
    assert store.batch_put_session_end(keys) == [0, 0]
    assert store.batch_put_session_end(["never"]) == [INVALID]
    assert store.get("block1") == b"".join(s.tobytes() for s in src)
    assert store.batch_get_session_start([*keys, "nope"]) == [0, 0, NOT_FOUND]
    with Counting(store) as count:
        for layer in reversed(range(layers)):
            rcs = store.batch_get_into_multi_buffer_ranges(
                keys[:1], [[dst[layer].ctypes.data]], [[page]], [[layer * page]])
            assert rcs == [page]
            assert np.array_equal(dst[layer], src[layer])
    assert count.rpcs == 0
    assert store.batch_get_session_end(keys) == 0
    assert store.batch_get_into_multi_buffer_ranges(keys[:1], [[dst[0].ctypes.data]], [[page]],
                                                    [[0]]) == [INVALID]
    # revoke releases the reservation; the key never appears
    assert store.batch_put_session_start(["rv"], [page]) == [0]
    assert store.batch_put_session_revoke(["rv", "never"]) == [0, INVALID]
    assert store.is_exist("rv") == 0
    assert store.batch_put_session_start(["block0"], [page]) == [
        int(ErrorCode.OBJECT_ALREADY_EXISTS)]


def test_session_ranges_reach_another_store_over_tcp(master: MasterProcess) -> None:
    # a pure client writes and reads session ranges of objects in another
    # store's segment through the transfer server (the writes carry the
    # reservation's capabilities)
    stores = _holder_and_client(master, tcp=True)
    holder, client = stores
    try:
        src, dst = arr(2048, 11), np.zeros(1024, np.uint8)
        assert client.batch_put_session_start(["tcp-sess"], [2048]) == [0]
        assert client.batch_put_from_multi_buffer_ranges(
            ["tcp-sess"], [[src.ctypes.data, src.ctypes.data + 1024]], [[1024, 1024]],
            [[0, 1024]]) == [2048]
        assert client.batch_put_session_end(["tcp-sess"]) == [0]
        assert holder.get("tcp-sess") == src.tobytes()
        assert client.batch_get_session_start(["tcp-sess"]) == [0]
        assert client.batch_get_into_multi_buffer_ranges(
            ["tcp-sess"], [[dst.ctypes.data]], [[1024]], [[512]]) == [1024]
        assert dst.tobytes() == src[512:1536].tobytes()
        assert holder.remove("tcp-sess", True) == 0
    finally:
        for s in stores:
            s.close()


def test_session_read_after_lease_expiry_is_refused(store: MooncakeDistributedStore) -> None:
    assert store.put("lk", bytes(range(256))) == 0
    buf = np.zeros(16, np.uint8)
    assert store.batch_get_session_start(["lk"]) == [0]
    time.sleep(LEASE_MS / 1000 + 0.2)
    assert store.batch_get_into_multi_buffer_ranges(["lk"], [[buf.ctypes.data]], [[16]],
                                                    [[0]]) == [int(ErrorCode.LEASE_EXPIRED)]


# ---------------------------------------------------------------------- admin


def test_replica_descriptors_and_clear(make_store: Callable[..., MooncakeDistributedStore]
                                       ) -> None:
    s = make_store()
    assert s.put("rd", b"12345") == 0
    (d,) = s.get_replica_desc("rd")
    assert str(d.status) == "ReplicaStatus.COMPLETE" and d.is_memory_replica()
    assert not d.is_disk_replica()
    m = d.get_memory_descriptor().buffer_descriptor
    assert m.size == 5 and m.transport_endpoint == s.get_hostname()
    assert s.get_replica_desc("nope") == []
    assert {k: len(v) for k, v in s.batch_get_replica_desc(["rd", "nope"]).items()} == {"rd": 1}
    assert s.batch_replica_clear([], "") == []
    assert s.batch_replica_clear(["rd", "nope"], "") == []  # under the read lease above
    time.sleep(LEASE_MS / 1000 + 0.2)
    assert s.batch_replica_clear(["rd"], "") == ["rd"] and s.get("rd") == b""


def test_tasks_and_segment_calls(store: MooncakeDistributedStore) -> None:
    assert store.put("t", b"x") == 0
    assert store.create_copy_task("nope", [store.get_hostname()])[1] == NOT_FOUND
    assert store.create_move_task("nope", "a", "b")[1] == NOT_FOUND
    assert store.create_copy_task("t", ["elsewhere"]) == ((0, 0), INVALID)
    assert store.query_task((1, 2)) == (None, int(ErrorCode.TASK_NOT_FOUND))
    assert store.mount_segment("/dev/shm/x", 1 << 20)["ret"] == int(ErrorCode.NOT_SUPPORTED)
    r = store.allocate_and_mount_segment(1 << 20)
    assert r == {"ret": int(ErrorCode.NOT_SUPPORTED), "segment_ids": [], "allocated_size": 0}
    assert store.alloc_from_mem_pool(1024) == 0 and store.get_offload_rpc_read_count() == 0


def test_client_http_endpoints(make_store: Callable[..., MooncakeDistributedStore]) -> None:
    import json
    import urllib.request

    from kvpool.cluster.processes import find_free_port

    port = find_free_port()
    s = make_store(enable_client_http_server=True, client_http_port=port)
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200 and r.read() == b"OK"
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        assert b"kvpool_mooncake_client_health 0" in r.read()
    with urllib.request.urlopen(base + "/metrics/summary", timeout=10) as r:
        assert json.loads(r.read())["hostname"] == s.get_hostname()


def test_async_wrapper_runs_every_call_off_the_loop(master: MasterProcess) -> None:
    async def run() -> None:
        s = MooncakeDistributedStoreAsync()
        assert await s.async_setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "",
                                   master.address) == 0
        try:
            assert await s.async_put("ak", b"async") == 0
            assert await s.async_get("ak") == b"async"
            assert await s.async_batch_is_exist(["ak", "no"]) == [1, 0]
            assert await s.async_remove("ak", True) == 0
            with pytest.raises(AttributeError):
                s.async_no_such_method  # noqa: B018
        finally:
            await s.async_close()

    asyncio.run(run())


def test_buffer_pool_leases(store: MooncakeDistributedStore) -> None:
    pool = mc.BufferPool(store, max_bytes=4 << 20)
    assert store.put("bp", bytes(range(200))) == 0
    with pool.buffer(1 << 20) as lease:
        assert store.get_into("bp", lease.ptr, lease.size) == 200
        assert bytes(lease.buffer[:200]) == bytes(range(200))
    leases = [pool.acquire(1 << 20) for _ in range(4)]
    with pytest.raises(RuntimeError):
        pool.acquire(1 << 20, block=False)
    with pytest.raises(RuntimeError):
        pool.close()  # leases still active
    for lease in leases:
        lease.release()
    pool.close()


def test_host_mem_allocator_gives_writable_memory() -> None:
    alloc = mc.MooncakeHostMemAllocator()
    ptr = alloc.alloc(1 << 20)
    assert ptr != 0
    view = (ctypes.c_uint8 * (1 << 20)).from_address(ptr)
    view[0], view[-1] = 7, 9
    assert (view[0], view[-1]) == (7, 9)
    del view
    assert alloc.free(ptr) == 0 and alloc.free(ptr) == -1


def test_ssd_offload_is_served_or_refused(master: MasterProcess, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    s = MooncakeDistributedStore()
    # no path and no disk tier on this host: a clear failure, never a silent drop
    assert s.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "", master.address,
                   enable_ssd_offload=True) == INVALID
    monkeypatch.setenv("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", str(32 << 20))
    assert s.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "", master.address,
                   enable_ssd_offload=True, ssd_offload_path=str(tmp_path / "ssd")) == 0
    try:
        disk = [x.descriptor for x in s._c().list_segments()
                if x.descriptor.kind == SegmentKind.FILE
                and x.descriptor.segment_id in s._c().segment_ids]
        assert disk and disk[0].size == 32 << 20
        assert (tmp_path / "ssd" / "slot-0" / "kvpool-segment.kvseg").exists()
        # a second store on the same path gets its own slot
        t = MooncakeDistributedStore()
        assert t.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "", master.address,
                       enable_ssd_offload=True, ssd_offload_path=str(tmp_path / "ssd")) == 0
        assert (tmp_path / "ssd" / "slot-1" / "kvpool-segment.kvseg").exists()
        # now the host has a disk tier: a store without a path is served by it
        u = MooncakeDistributedStore()
        assert u.setup("localhost", "P2PHANDSHAKE", SEG, SEG, "tcp", "", master.address,
                       enable_ssd_offload=True) == 0
        u.close()
        t.close()
        # disk-only placement lands in the SSD tier and reads back
        cfg = ReplicateConfig()
        cfg.replica_num, cfg.nof_replica_num = 0, 1
        data = arr(100_000, 8).tobytes()
        assert s.put("on-disk", data, cfg) == 0 and s.get("on-disk") == data
        (d,) = s.get_replica_desc("on-disk")
        assert d.is_disk_replica() and d.is_local_disk_replica()
        assert d.get_disk_descriptor().object_size == 100_000
    finally:
        s.remove_all(True)
        s.close()
