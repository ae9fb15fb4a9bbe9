"""The store Client against a real master and two real node daemons on loopback."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess, find_free_port
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import Exist, ListSegments
from kvpool.store import Client, ClientConfig, ReplicateConfig
from kvpool.store.errors import (
    AlreadyExists,
    BufferTooSmall,
    ChecksumMismatch,
    MasterUnreachable,
    NoSpace,
    ObjectNotFound,
    StoreError,
)
from kvpool.transfer.segment import shm_tag_prefix
from support.threads import run_in_threads

Key = Callable[..., str]
LEASE_TTL_MS = 1000  # the master fixture's lease (conftest.py)


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [1, 4096, 1 << 20, 5 << 20 | 7])
def test_put_get_roundtrip(client: Client, key: Key, size: int) -> None:
    data = _payload(size, size)
    client.put(key(), data)
    got = client.get(key())
    assert type(got) is bytes and got == data
    assert client.get_size(key()) == size
    assert client.exists(key())


def test_missing_key_errors(client: Client, key: Key) -> None:
    with pytest.raises(ObjectNotFound) as ei:
        client.get(key("nope"))
    assert ei.value.code == ErrorCode.OBJECT_NOT_FOUND
    with pytest.raises(ObjectNotFound):
        client.get_into(key("nope"), bytearray(16))
    with pytest.raises(ObjectNotFound):
        client.get_size(key("nope"))
    with pytest.raises(ObjectNotFound):
        client.remove(key("nope"))
    assert client.exists(key("nope")) is False


def test_put_existing_key_keeps_value(client: Client, key: Key) -> None:
    client.put(key(), b"first")
    with pytest.raises(AlreadyExists) as ei:
        client.put(key(), b"second value")
    assert ei.value.code == ErrorCode.OBJECT_ALREADY_EXISTS
    assert client.get(key()) == b"first"


@pytest.mark.parametrize("bad", ["", 7, "x" * 5000])
def test_invalid_keys(client: Client, bad: object) -> None:
    for call in (lambda: client.put(bad, b"v"), lambda: client.get(bad),  # type: ignore[arg-type]
                 lambda: client.exists(bad), lambda: client.remove(bad)):  # type: ignore[arg-type]
        with pytest.raises(StoreError) as ei:
            call()
        assert ei.value.code == ErrorCode.INVALID_KEY


def test_empty_value_rejected(client: Client, key: Key) -> None:
    with pytest.raises(StoreError) as ei:
        client.put(key(), b"")
    assert ei.value.code == ErrorCode.INVALID_PARAMS


def test_put_from_get_into_numpy_and_registered(client: Client, key: Key) -> None:
    src = np.random.default_rng(1).random(300_000).astype(np.float32)
    client.put_from(key("a"), src)
    dst = np.zeros_like(src)
    assert client.get_into(key("a"), dst) == src.nbytes
    assert np.array_equal(src, dst)
    # registered buffers: put from one, read into another, both reused
    reg_src = np.arange(1 << 18, dtype=np.uint8)
    reg_dst = np.zeros(1 << 19, dtype=np.uint8)
    hs, hd = client.register_buffer(reg_src), client.register_buffer(reg_dst)
    try:
        client.put_from(key("b"), hs)
        assert client.get_into(key("b"), hd) == reg_src.nbytes
        assert np.array_equal(reg_dst[: reg_src.nbytes], reg_src)
    finally:
        client.unregister_buffer(hs)
        client.unregister_buffer(hd)
    # raw (address, length) and bytearray destinations
    ba = bytearray(src.nbytes)
    assert client.get_into(key("a"), ba) == src.nbytes and bytes(ba) == src.tobytes()
    raw = np.zeros(src.nbytes, dtype=np.uint8)
    assert client.get_into(key("a"), (raw.ctypes.data, raw.nbytes)) == src.nbytes
    assert raw.tobytes() == src.tobytes()


def test_get_into_too_small(client: Client, key: Key) -> None:
    client.put(key(), b"y" * 1000)
    small = bytearray(b"z" * 999)
    with pytest.raises(BufferTooSmall) as ei:
        client.get_into(key(), small)
    assert ei.value.code == ErrorCode.BUFFER_OVERFLOW
    assert small == bytearray(b"z" * 999)  # nothing written


def test_batches(client: Client, key: Key) -> None:
    client.put(key("old"), b"old")
    keys = [key("b0"), key("b1"), key("old"), "", key("b0")]
    vals = [b"v0", b"v1" * 1000, b"new", b"x", b"dup"]
    codes = client.put_batch(keys, vals)
    assert codes == [ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS,
                     ErrorCode.INVALID_KEY, ErrorCode.OBJECT_ALREADY_EXISTS]
    got = client.get_batch([key("b1"), key("missing"), key("old"), key("b0")])
    assert got == [b"v1" * 1000, None, b"old", b"v0"]
    assert client.batch_exists([key("missing"), key("b0"), key("b1")]) == [False, True, True]
    assert client.batch_exists([]) == []
    assert client.get_batch([]) == []


def test_batch_put_of_valid_keys_one_stored(client: Client, key: Key) -> None:
    """Distinct valid keys (the batch put's fast key checks), one of them
    stored already: the master refuses that one, the others are committed."""
    client.put(key("s1"), b"old")
    keys = [key("s0"), key("s1"), key("s2")]
    bufs = [np.full(4096, i, np.uint8) for i in range(3)]
    assert client.batch_put_from(keys, bufs) == [
        ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.OK]
    assert client.get_batch(keys) == [bufs[0].tobytes(), b"old", bufs[2].tobytes()]


@pytest.mark.usefixtures("daemons")
def test_batch_put_from_registered_buffers_of_any_byte_layout(
        make_client: Callable[..., Client], key: Key) -> None:
    """Registered uint8 buffers are copied (inline, to the daemons' shared
    memory) through memoryviews; other one-byte layouts (int8) and raw
    buffers take numpy's copy: the same bytes."""
    client = make_client()  # no checksums: the batch put's fast size path
    rng = np.random.default_rng(5)
    u8 = rng.integers(0, 256, 4096, dtype=np.uint8)
    i8 = rng.integers(-128, 128, 4096, dtype=np.int8)
    raw = bytearray(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    keys = [key("u8"), key("i8"), key("raw")]
    handles = [client.register_buffer(u8), client.register_buffer(i8), raw]
    assert client.batch_put_from(keys, handles) == [ErrorCode.OK] * 3
    assert client.get_batch(keys) == [u8.tobytes(), i8.tobytes(), bytes(raw)]
    outs = [np.zeros(4096, np.uint8), np.zeros(4096, np.int8)]
    reg = [client.register_buffer(o) for o in outs]
    assert client.batch_get_into(keys[:2], reg) == [4096, 4096]
    assert np.array_equal(outs[0], u8) and np.array_equal(outs[1], i8)
    assert client.get_into(keys[0], reg[1]) == 4096
    assert outs[1].tobytes() == u8.tobytes()
    assert client.engine.transport("shm").bytes_copied >= 6 * 4096


def test_batch_put_from_get_into(client: Client, key: Key) -> None:
    rng = np.random.default_rng(2)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 65536, 1 << 20)]
    keys = [key(f"z{i}") for i in range(3)]
    assert client.batch_put_from(keys, srcs) == [ErrorCode.OK] * 3
    dsts = [np.zeros_like(s) for s in srcs] + [np.zeros(10, np.uint8), np.zeros(8, np.uint8)]
    res = client.batch_get_into([*keys, key("gone"), keys[0]], dsts)
    assert res[:3] == [s.nbytes for s in srcs]
    assert res[3] == ErrorCode.OBJECT_NOT_FOUND and res[4] == ErrorCode.BUFFER_OVERFLOW
    for s, d in zip(srcs, dsts, strict=False):
        assert np.array_equal(s, d)
    with pytest.raises(StoreError) as ei:
        client.batch_get_into(keys, dsts[:2])
    assert ei.value.code == ErrorCode.INVALID_PARAMS


def test_remove_respects_lease_and_force(client: Client, key: Key) -> None:
    client.put(key("a"), b"a")
    client.put(key("b"), b"b")
    assert client.get(key("a")) == b"a"  # grants a read lease
    with pytest.raises(StoreError) as ei:
        client.remove(key("a"))
    assert ei.value.code == ErrorCode.OBJECT_HAS_LEASE
    time.sleep(LEASE_TTL_MS / 1000 + 0.3)
    client.remove(key("a"))
    assert not client.exists(key("a"))
    client.exists(key("b"))  # lease again
    client.remove(key("b"), force=True)
    with pytest.raises(ObjectNotFound):
        client.get(key("b"))


def test_two_replicas_on_distinct_segments(client: Client, key: Key,
                                           daemons: list[NodeDaemonProcess]) -> None:
    data = _payload(100_000, 3)
    client.put(key(), data, ReplicateConfig(replica_num=2))
    segs = client.replica_segments(key())
    assert len(segs) == 2 and set(segs) == {d.segment_ids[0] for d in daemons}
    assert client.get(key()) == data
    target = daemons[1].segment_ids[0]
    client.put(key("p"), data, ReplicateConfig(preferred_segments=[target]))
    assert client.replica_segments(key("p")) == [target]


def test_no_space_for_value_larger_than_any_segment(client: Client, key: Key) -> None:
    with pytest.raises(NoSpace) as ei:
        client.put(key(), bytes(40 << 20))
    assert ei.value.code == ErrorCode.NO_AVAILABLE_HANDLE
    assert not client.exists(key())


def test_checksum_mismatch_detected(client: Client, key: Key,
                                    daemons: list[NodeDaemonProcess]) -> None:
    client.put(key(), b"A" * 8192)
    (loc,) = client.batch_locate([key()])
    (rep,) = loc.replicas
    owner = next(d for d in daemons if rep.segment_id in d.segment_ids)
    name = owner.info["shm_names"][owner.segment_ids.index(rep.segment_id)]
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as mm:
            mm[rep.offset + 100] = ord("B")  # flip one byte behind the store's back
    finally:
        os.close(fd)
    with pytest.raises(ChecksumMismatch) as ei:
        client.get(key())
    assert ei.value.code == ErrorCode.CHECKSUM_MISMATCH
    assert client.batch_get_into([key()], [bytearray(8192)]) == [ErrorCode.CHECKSUM_MISMATCH]
    # a registered buffer is verified too
    registered = client.register_buffer(np.zeros(8192, np.uint8))
    with pytest.raises(ChecksumMismatch):
        client.get_into(key(), registered)
    assert client.batch_get_into([key()], [registered]) == [ErrorCode.CHECKSUM_MISMATCH]


def test_contributing_client_lifecycle(master: MasterProcess, daemons: list[NodeDaemonProcess],
                                       key: Key) -> None:
    before = {t.name for t in threading.enumerate()}
    with Client(ClientConfig(master_address=master.address, memory_size=8 << 20,
                             ping_interval_s=0.2)) as owner:
        (seg,) = owner.segment_ids
        (shm,) = owner.shm_names
        assert shm_exists(shm) and shm.startswith(shm_tag_prefix())
        with master.client() as mc:
            ids = {s.descriptor.segment_id for s in mc.call(ListSegments()).segments}
        assert seg in ids
        owner.put(key(), b"mine", ReplicateConfig(preferred_segments=[seg]))
        assert owner.replica_segments(key()) == [seg]
        assert owner.get(key()) == b"mine"  # read from its own segment
    assert not shm_exists(shm)
    with master.client() as mc:
        ids = {s.descriptor.segment_id for s in mc.call(ListSegments()).segments}
        assert seg not in ids
        # the closed client's data left the pool with its segment
        assert mc.call(Exist(key=key())).exists is False
    time.sleep(0.1)
    leaked = {t.name for t in threading.enumerate()} - before
    assert not [n for n in leaked if n.startswith("kvpool-ping")]
    with pytest.raises(StoreError) as ei:
        owner.get(key())
    assert ei.value.code == ErrorCode.CLOSED


def test_master_unreachable_fails_fast() -> None:
    cfg = ClientConfig(master_address=f"127.0.0.1:{find_free_port()}", rpc_timeout_s=0.5,
                       memory_size=4 << 20)
    t = time.monotonic()
    c = Client(cfg)
    with pytest.raises(MasterUnreachable) as ei:
        c.setup()
    assert time.monotonic() - t < 5
    assert ei.value.code in (ErrorCode.RPC_TIMEOUT, ErrorCode.RPC_FAIL)
    c.close()


def test_remove_all(make_client: Callable[..., Client], daemons: list[NodeDaemonProcess],
                    key: Key) -> None:
    c = make_client()
    for i in range(5):
        c.put(key(str(i)), b"x" * (i + 1))
    removed = c.remove_all(force=True)
    assert removed >= 5
    assert c.batch_exists([key(str(i)) for i in range(5)]) == [False] * 5


def test_same_host_copies_of_every_size_through_shm(make_client: Callable[..., Client],
                                                    daemons: list[NodeDaemonProcess],
                                                    key: Key) -> None:
    """Same-host copies of small, middle and large values (memoryview copies,
    numpy copies, copies split across threads) go through the shm transport
    on the calling thread, checksummed; every form reads the same bytes."""
    c = make_client(checksum="crc32")
    vals = [_payload(n, n) for n in (10, 70_000, 5 << 20)]
    keys = [key(str(i)) for i in range(3)]
    assert c.put_batch(keys[:2], vals[:2], ReplicateConfig(replica_num=2)) == [ErrorCode.OK] * 2
    c.put(keys[2], vals[2])
    assert c.get_batch(keys) == vals
    assert [c.get(k) for k in keys] == vals
    dst = [np.zeros(len(v), np.uint8) for v in vals]
    assert c.batch_get_into(keys, dst) == [len(v) for v in vals]
    assert [d.tobytes() for d in dst] == vals
    shm = c.engine.transport("shm")
    assert shm.bytes_copied >= 2 * sum(map(len, vals))
    assert shm.stats()["mapped_segments"] == len(daemons)  # one mapping per peer's file


def test_threads_share_one_client(client: Client, key: Key) -> None:
    """Concurrent calls from many threads (each with its own RPC socket) all
    land, and close() releases every socket."""

    def work(t: int) -> None:
        for i in range(10):
            k = key(f"t{t}/{i}")
            v = _payload(1000 + t * 10 + i, t * 100 + i)
            client.put(k, v)
            assert client.get(k) == v

    run_in_threads(work, 6, 30)
    assert 1 < len(client._parts.session._all) <= 7
