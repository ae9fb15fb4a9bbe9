"""The GPU code paths of shm and tcp (registration, staging pool, memcpy
direction and offsets) on this CPU-only machine, through a TEST DOUBLE of the
CUDA runtime: "device" memory is host memory and cudaMemcpy is memmove. It
proves the bookkeeping, not the DMA; the real thing is tests/transfer/test_gpu.py
and scripts/gpu_check_transfer.py on a GPU machine."""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np
import pytest

from kvpool.transfer import TransferOp, TransferRequest
from kvpool.transfer import gpu as gpu_mod
from kvpool.transfer.gpu import independent_copies
from support.cuda_double import HostCudaDouble

MiB = 1 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_gpu_paths_through_double(cuda_double: HostCudaDouble, make_engine: Any,
                                  make_peer: Any, transport: str) -> None:
    n = 9 * MiB + 5  # > staging_size: several staged chunks
    peer = make_peer(16 * MiB, host_id="host-test")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"staging_size": "1MiB",
                                                                   "staging_buffers": 3}}})
    e.add_peer_segment(peer.desc)
    data = np.random.default_rng(9).integers(0, 256, n, dtype=np.uint8)
    fake_dev = np.zeros(n + 64, np.uint8)  # "device" memory of the double
    fake_dev[64:] = data
    src = e.register_buffer((int(fake_dev.ctypes.data), n + 64), device="cuda")
    assert src.is_gpu
    st = e.transfer([TransferRequest(TransferOp.WRITE, src, peer.segment_id, 4093, n,
                                     buffer_offset=64, transport=transport)], 30)
    assert st[0].ok, st
    assert peer.crc(4093, n) == zlib.crc32(data)
    back = np.zeros(n, np.uint8)
    dst = e.register_buffer((int(back.ctypes.data), n), device="cuda")
    st = e.transfer([TransferRequest(TransferOp.READ, dst, peer.segment_id, 4093, n,
                                     transport=transport)], 30)
    assert st[0].ok, st
    assert (back == data).all()
    if transport == "shm":
        # the peer's mapping was registered once, whole, and copies went straight to
        # it: queued on the legacy stream, one wait per batch
        assert list(cuda_double.registered.values()) == [16 * MiB]
        assert cuda_double.async_copies == [0, 0] and cuda_double.syncs == [0, 0]
        e.remove_peer_segment(peer.segment_id)
        assert cuda_double.registered == {}
    else:
        # staged through the pinned pool: 3 buffers of 1 MiB, one copy per chunk; the
        # same-host peer's mapping was also page-locked (GPU warm-up) for shm
        assert e.wait_gpu_ready(10)
        assert sorted(cuda_double.registered.values()) == [MiB] * 3 + [16 * MiB]
        assert cuda_double.copies == 2 * 10


class CountingDouble(HostCudaDouble):
    """The double, counting registrations and slowing them like a real one
    (cudaHostRegister of a fresh mapping faults and pins every page)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_calls = 0

    def host_register(self, ptr: int, n: int) -> None:
        self.register_calls += 1
        time.sleep(0.05)
        super().host_register(ptr, n)


def test_gpu_warm_up_registers_segments_off_the_request_path(
        monkeypatch: pytest.MonkeyPatch, make_engine: Any, make_peer: Any) -> None:
    """Once a GPU buffer is registered, every same-host segment (known before or
    learned after) is page-locked in the background, and another host's segment
    warms the tcp staging pool; GPU requests then register nothing."""
    rt = CountingDouble()
    monkeypatch.setattr(gpu_mod, "_cached", (rt, ""))
    near = make_peer(8 * MiB, host_id="host-test")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"staging_size": "1MiB",
                                                                   "staging_buffers": 2}}})
    e.add_peer_segment(near.desc)
    assert rt.registered == {}  # no GPU buffer yet: nothing prepared
    fake_dev = np.random.default_rng(4).integers(0, 256, 2 * MiB, dtype=np.uint8)
    h = e.register_buffer((int(fake_dev.ctypes.data), fake_dev.nbytes), device="cuda")
    assert e.wait_gpu_ready(10)
    assert sorted(rt.registered.values()) == [8 * MiB]
    later = make_peer(4 * MiB, host_id="host-test")
    far = make_peer(4 * MiB, host_id="far-away")
    e.add_peer_segment(later.desc)
    e.add_peer_segment(far.desc)
    assert e.wait_gpu_ready(10)
    assert sorted(rt.registered.values()) == [MiB, MiB, 4 * MiB, 8 * MiB]
    calls = rt.register_calls
    for peer, transport in ((near, "shm"), (later, "shm"), (far, "tcp")):
        for off in (0, MiB):
            st = e.transfer([TransferRequest(TransferOp.WRITE, h, peer.segment_id, off, MiB,
                                             buffer_offset=off)], 30)
            assert st[0].ok and st[0].transport == transport, st
        assert peer.crc(0, 2 * MiB) == zlib.crc32(fake_dev)
    assert rt.register_calls == calls  # nothing registered on the request path
    # a forgotten segment's registration is released, a re-learned one prepared again
    e.remove_peer_segment(near.segment_id)
    assert sorted(rt.registered.values()) == [MiB, MiB, 4 * MiB]


def test_local_segment_registered_once_and_released(cuda_double: HostCudaDouble,
                                                     make_engine: Any,
                                                     make_segment: Any) -> None:
    e = make_engine()
    seg = make_segment(MiB)
    e.add_local_segment(seg)
    fake_dev = np.arange(4096, dtype=np.uint32).view(np.uint8)
    h = e.register_buffer((int(fake_dev.ctypes.data), fake_dev.nbytes), device="cuda")
    for off in (0, 8192, 65536):
        st = e.transfer([TransferRequest(TransferOp.WRITE, h, seg.segment_id, off, 4096)], 5)
        assert st[0].ok and st[0].transport == "shm"
        assert seg.array()[off:off + 4096].tobytes() == fake_dev[:4096].tobytes()
    assert list(cuda_double.registered) == [seg.address]
    seg.close()
    assert cuda_double.registered == {}


def test_tcp_staging_pool_shared_by_threads_never_deadlocks(
        cuda_double: HostCudaDouble, make_engine: Any, make_peer: Any) -> None:
    """Regression (seen on the H200): two tcp worker threads sharing a small
    pinned pool each held slots in flight while blocking for more, so neither
    read the replies that would free them. The batch must finish."""
    chunk, count = MiB, 16
    peer = make_peer(chunk * count, host_id="host-test")
    e = make_engine("host-test", overrides={"transports": {"tcp": {
        "staging_size": "256KiB", "staging_buffers": 4, "threads": 2, "window": 8}}})
    e.add_peer_segment(peer.desc)
    data = np.random.default_rng(3).integers(0, 256, chunk * count, dtype=np.uint8)
    src = e.register_buffer((int(data.ctypes.data), data.nbytes), device="cuda")
    reqs = [TransferRequest(TransferOp.WRITE, src, peer.segment_id, i * chunk, chunk,
                            buffer_offset=i * chunk, transport="tcp") for i in range(count)]
    st = e.transfer(reqs, 30)
    assert all(s.ok for s in st), [s.errors for s in st if not s.ok][:2]
    assert peer.crc(0, chunk * count) == zlib.crc32(data)


def test_store_first_gpu_put_finds_the_holder_prepared(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The store path of a single GPU put_from (a holder daemon on this host): the
    first registered GPU buffer makes the client learn the memory segments and
    page-lock the holder's mapping in the background, so neither the first put
    nor later ones register anything, and the bytes round-trip."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.store import Client, ClientConfig

    rt = CountingDouble()
    monkeypatch.setattr(gpu_mod, "_cached", (rt, ""))
    with MasterProcess() as m, NodeDaemonProcess(m.address, "32MiB",
                                                 log_dir=str(tmp_path / "d")) as d, \
            Client(ClientConfig(master_address=m.address)) as c:
        fake_dev = np.random.default_rng(5).integers(0, 256, 4 * MiB, dtype=np.uint8)
        back = np.zeros(4 * MiB, np.uint8)
        h = c.register_buffer((int(fake_dev.ctypes.data), fake_dev.nbytes), device="cuda")
        hb = c.register_buffer((int(back.ctypes.data), back.nbytes), device="cuda")
        assert c.engine.wait_gpu_ready(10)
        assert sorted(rt.registered.values()) == [32 * MiB]  # the holder's whole segment
        calls = rt.register_calls
        for i in range(4):
            c.put_from(f"gpu/{i}", h)
            assert c.replica_segments(f"gpu/{i}") == d.segment_ids
            back[:] = 0
            assert c.get_into(f"gpu/{i}", hb) == 4 * MiB
            assert zlib.crc32(back) == zlib.crc32(fake_dev)
        assert rt.register_calls == calls


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_independent_copies_run_on_the_side_stream(cuda_double: HostCudaDouble,
                                                   make_engine: Any, make_peer: Any,
                                                   transport: str) -> None:
    """Inside independent_copies a transfer's GPU copies are asynchronous copies
    on the copying thread's side stream, each waited for; outside, plain
    (legacy-stream) cudaMemcpy. The flag is the submitting thread's, also
    when an engine worker thread does the copy."""
    n = 3 * MiB + 7
    peer = make_peer(8 * MiB, host_id="host-test")
    e = make_engine("host-test", overrides={"transports": {"tcp": {"staging_size": "1MiB",
                                                                   "staging_buffers": 2}}})
    e.add_peer_segment(peer.desc)
    data = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
    src = e.register_buffer((int(data.ctypes.data), n), device="cuda")
    back = np.zeros(n, np.uint8)
    dst = e.register_buffer((int(back.ctypes.data), n), device="cuda")
    with independent_copies():
        st = e.transfer([TransferRequest(TransferOp.WRITE, src, peer.segment_id, 0, n,
                                         transport=transport)], 30)
        assert st[0].ok, st
        st = e.transfer([TransferRequest(TransferOp.READ, dst, peer.segment_id, 0, n,
                                         transport=transport)], 30)
        assert st[0].ok, st
    assert (back == data).all()
    copies = 2 if transport == "shm" else 2 * 4  # tcp: one per 1 MiB staged chunk
    # shm: a batch's copies queued, then one wait per batch
    assert cuda_double.copies == 0
    assert cuda_double.async_copies == [1000] * copies
    assert cuda_double.syncs == [1000] * (2 if transport == "shm" else copies)
    back[:] = 0
    st = e.transfer([TransferRequest(TransferOp.READ, dst, peer.segment_id, 0, n,
                                     transport=transport)], 30)
    assert st[0].ok and (back == data).all()
    if transport == "shm":  # the legacy stream
        assert cuda_double.async_copies[copies:] == [0] and cuda_double.syncs[2:] == [0]
    else:  # cudaMemcpy per staged chunk
        assert cuda_double.copies == copies // 2 and len(cuda_double.async_copies) == copies


def test_store_multi_part_gpu_values_are_staged_once_per_call(
        cuda_double: HostCudaDouble, tmp_path: Any) -> None:
    """batch_put_parts / batch_get_parts with several GPU parts per key (vLLM's
    per-layer K/V segments of a block): the parts are gathered into (scattered
    from) one device staging buffer with one 2-D copy per part position, and
    the transfer moves one range per key; the bytes round-trip, short parts
    included, and a key that misses leaves its parts untouched."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.store import Client, ClientConfig
    from kvpool.transfer import as_buffer

    layers, blocks, bb, keys = 4, 16, 4096, 8
    rng = np.random.default_rng(6)
    caches = [rng.integers(0, 256, (2, blocks, bb), dtype=np.uint8) for _ in range(layers)]
    outs = [np.zeros_like(t) for t in caches]

    def parts(cache: list[np.ndarray], b: int) -> list[Any]:
        return [as_buffer((int(t.ctypes.data) + kv * blocks * bb + b * bb, bb), device="cuda")
                for t in cache for kv in range(2)]

    with MasterProcess() as m, NodeDaemonProcess(m.address, "32MiB",
                                                 log_dir=str(tmp_path / "d")), \
            Client(ClientConfig(master_address=m.address)) as c:
        for t in caches + outs:
            c.register_buffer((int(t.ctypes.data), t.nbytes), device="cuda")
        assert c.engine.wait_gpu_ready(10)
        names = [f"mb/{b}" for b in range(keys)]
        codes = c.batch_put_parts(names, [parts(caches, b) for b in range(keys)])
        assert codes == [0] * keys
        # one 2-D copy per part position (2 per layer), keys rows each, then the
        # keys' D2H copies (one per key at most: keys next to each other in the
        # staging buffer and in the segment are one copy); each step waited for
        # once, on the legacy stream (after the caller's kernels)
        assert cuda_double.rows_2d == 2 * layers * keys
        put_copies = len(cuda_double.async_copies)
        assert 2 * layers < put_copies <= 2 * layers + keys
        assert cuda_double.syncs == [0, 0] and cuda_double.copies == 0
        assert len(cuda_double.device_memory) == 1  # the staging buffer, kept for reuse
        got = c.batch_get_parts([*names, "mb/missing"],
                                [parts(outs, keys + b) for b in range(keys)]
                                + [parts(outs, 2 * keys)])
        assert got[:keys] == [2 * layers * bb] * keys and got[keys] < 0
        for t, o in zip(caches, outs, strict=True):
            assert (o[:, keys:2 * keys] == t[:, :keys]).all()
            assert not o[:, 2 * keys:].any()
        assert cuda_double.rows_2d == 2 * 2 * layers * keys
        get_copies = len(cuda_double.async_copies) - put_copies
        assert 2 * layers < get_copies <= 2 * layers + keys
        assert cuda_double.syncs == [0] * 4
        assert len(cuda_double.device_memory) == 1
        # a last part larger than the rest of the object: filled in part, in order
        n = 2 * layers * bb
        extra = np.zeros(3 * n, np.uint8)
        uneven = [as_buffer((int(extra.ctypes.data), bb), device="cuda"),
                  as_buffer((int(extra.ctypes.data) + n, 2 * n), device="cuda")]
        assert c.batch_get_parts(["mb/0", "mb/1"], [uneven, parts(outs, 3)]) == [n, n]
        flat = np.concatenate([t[kv, 0] for t in caches for kv in range(2)])
        assert (extra[:bb] == flat[:bb]).all() and not extra[bb:n].any()
        assert (extra[n:2 * n - bb] == flat[bb:]).all() and not extra[2 * n - bb:].any()
        for t, o in zip(caches, outs, strict=True):
            assert (o[:, 3] == t[:, 1]).all()
    assert cuda_double.device_memory == {}  # freed at close
