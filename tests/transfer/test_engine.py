"""In-process engine behaviour: buffer kinds, selection, sub-batches, failover,
validation. Segments are real /dev/shm; tcp goes through the real server."""

from __future__ import annotations

import ctypes
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentKind
from kvpool.transfer import (
    RequestState,
    TransferError,
    TransferOp,
    TransferRequest,
)
from kvpool.transfer.counters import Direction
from kvpool.transfer.engine import SubBatchState
from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
from support.wait import wait_until

R, W = TransferOp.READ, TransferOp.WRITE


def _pattern(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class FlakyTransport(Transport):
    """Test-only transport: fails every request (retryably), counts calls."""

    name = "flaky"

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.calls = 0
        self.delay = delay

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, kind: SegmentKind, same_host: bool, device: str) -> bool:
        return True

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        self.calls += 1
        time.sleep(self.delay)
        for it in items:
            report(it, TransferError("flaky on purpose", ErrorCode.TRANSFER_FAIL))


class HangingTransport(FlakyTransport):
    """Test-only transport that never reports and returns only at the deadline."""

    name = "hang"

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        self.calls += 1
        time.sleep(max(0.0, deadline - time.monotonic()))


@pytest.fixture(autouse=True)
def _transport_classes_restored() -> Iterator[None]:
    """Fake transports registered by a test are gone after it (the table is
    global: tests/core/test_config_docs.py checks it against the YAML)."""
    from kvpool.transfer.transports import TRANSPORT_CLASSES

    saved = dict(TRANSPORT_CLASSES)
    yield
    TRANSPORT_CLASSES.clear()
    TRANSPORT_CLASSES.update(saved)


def _register_fake(cls_name: str) -> None:
    from kvpool.transfer.transports import TRANSPORT_CLASSES

    # names must be known to the config validator; the module is this test file
    TRANSPORT_CLASSES.setdefault(cls_name, f"{__name__}:{cls_name.capitalize()}Transport")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_host_buffer_kind(make_engine: Any, make_segment: Any, transport: str) -> None:
    e = make_engine()
    seg = make_segment(1 << 16)
    e.add_local_segment(seg)
    data = _pattern(1000)
    ba = bytearray(1000)
    raw = (ctypes.c_ubyte * 1000)()
    sources: list[Any] = [bytes(data), bytearray(data), memoryview(bytearray(data)), data,
                          (ctypes.addressof(ctypes.c_char.from_buffer(bytearray(data))), 0)]
    sources.pop()  # (addr, len) is exercised below with a buffer we keep alive
    for k, src in enumerate(sources):
        st = e.transfer([TransferRequest(W, src, seg.segment_id, k * 1000, 1000,
                                         transport=transport)], timeout=5)
        assert st[0].ok and st[0].transport == transport, st
    assert (seg.array()[: 4000].reshape(4, 1000) == data).all()
    for dst in (ba, memoryview(ba), np.frombuffer(ba, np.uint8), (ctypes.addressof(raw), 1000)):
        ba[:] = b"\0" * 1000
        ctypes.memset(raw, 0, 1000)
        st = e.transfer([TransferRequest(R, dst, seg.segment_id, 2000, 1000,
                                         transport=transport)], timeout=5)
        assert st[0].ok, st
        got = bytes(raw) if isinstance(dst, tuple) else bytes(ba)
        assert got == data.tobytes()
    # registered buffer, partial slice with buffer_offset
    h = e.register_buffer(bytearray(3000))
    st = e.transfer([TransferRequest(R, h, seg.segment_id, 1500, 1000, buffer_offset=1999,
                                     transport=transport)], timeout=5)
    assert st[0].ok
    assert bytes(h.host_view(1999, 1000)) == seg.array()[1500:2500].tobytes()
    e.unregister_buffer(h)


def test_torch_cpu_tensor_roundtrip(make_engine: Any, make_segment: Any) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    e = make_engine()
    seg = make_segment(1 << 16)
    e.add_local_segment(seg)
    src = torch.arange(256, dtype=torch.float32)
    dst = torch.zeros(256, dtype=torch.float32)
    for t in ("shm", "tcp"):
        assert e.transfer([TransferRequest(W, src, seg.segment_id, 64, 1024, transport=t)], 5)[0].ok
        assert e.transfer([TransferRequest(R, dst, seg.segment_id, 64, 1024, transport=t)], 5)[0].ok
        assert torch.equal(src, dst)
        dst.zero_()


@pytest.mark.parametrize("size", [1, 3, 4095, 65537, (1 << 20) + 7, 16 << 20, 64 << 20])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_checksums_unaligned(make_engine: Any, make_segment: Any, size: int,
                             transport: str) -> None:
    e = make_engine()
    seg = make_segment((64 << 20) + 4096)
    e.add_local_segment(seg)
    src = _pattern(size + 5, seed=size)
    off = 4093 if size < (64 << 20) else 3
    st = e.transfer([TransferRequest(W, src, seg.segment_id, off, size, buffer_offset=5,
                                     transport=transport)], timeout=30)
    assert st[0].ok, st
    assert zlib.crc32(seg.array()[off:off + size]) == zlib.crc32(src[5:])
    dst = np.zeros(size + 11, np.uint8)
    st = e.transfer([TransferRequest(R, dst, seg.segment_id, off, size, buffer_offset=11,
                                     transport=transport)], timeout=30)
    assert st[0].ok, st
    assert zlib.crc32(dst[11:]) == zlib.crc32(src[5:])


def test_validation_failures_are_immediate_and_typed(make_engine: Any,
                                                      make_segment: Any) -> None:
    e = make_engine()
    seg = make_segment(4096)
    e.add_local_segment(seg)
    buf = bytearray(100)
    reqs = [
        TransferRequest(R, buf, seg.segment_id, 4090, 10),       # past segment end
        TransferRequest(R, buf, seg.segment_id, -1, 10),         # negative offset
        TransferRequest(R, buf, "nope", 0, 10),                  # unknown segment
        TransferRequest(R, buf, seg.segment_id, 0, 10, buffer_offset=95),  # buffer overflow
        TransferRequest(R, b"x" * 10, seg.segment_id, 0, 10),    # READ into bytes
        TransferRequest(R, object(), seg.segment_id, 0, 10),     # not a buffer
        TransferRequest(R, buf, seg.segment_id, 0, 10, transport="warp"),  # unknown hint
        TransferRequest(W, buf, seg.segment_id, 0, 0),           # empty: done at once
        TransferRequest(W, buf, seg.segment_id, 0, 10),          # valid
    ]
    st = e.transfer(reqs, timeout=5)
    codes = [s.code for s in st]
    assert codes == [ErrorCode.OUT_OF_BOUNDS, ErrorCode.OUT_OF_BOUNDS,
                     ErrorCode.SEGMENT_NOT_FOUND, ErrorCode.BUFFER_OVERFLOW,
                     ErrorCode.INVALID_PARAMS, ErrorCode.INVALID_PARAMS,
                     ErrorCode.INVALID_PARAMS, ErrorCode.OK, ErrorCode.OK]
    assert [s.state for s in st[-2:]] == [RequestState.DONE, RequestState.DONE]
    assert all(s.errors for s in st[:7])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_alike_requests_checked_one_by_one(make_engine: Any, make_segment: Any,
                                           transport: str) -> None:
    """Requests alike in segment, device and length are resolved once in a
    submit; each one's own range, buffer and op are still checked, with the
    codes the first request of its kind would get."""
    e = make_engine(overrides={"rules": [{"name": "t", "transports": [transport]}]})
    seg = make_segment(1 << 16)
    e.add_local_segment(seg)
    src = [e.register_buffer(_pattern(4096, i)) for i in range(4)]
    frozen = _pattern(4096, 9)
    frozen.flags.writeable = False
    ro = e.register_buffer(frozen)
    assert ro.readonly
    reqs = [TransferRequest(W, src[0], seg.segment_id, 0, 4096),
            TransferRequest(W, src[1], seg.segment_id, 4096, 4096),
            TransferRequest(W, src[2], seg.segment_id, (1 << 16) - 100, 4096),  # past the end
            TransferRequest(W, src[2], seg.segment_id, -4096, 4096),            # negative
            TransferRequest(W, src[2], seg.segment_id, 8192, 4096, buffer_offset=1),  # overflow
            TransferRequest(W, ro, seg.segment_id, 12288, 4096),                # read-only source
            TransferRequest(W, src[3], seg.segment_id, 16384, 4096)]
    st = e.transfer(reqs, timeout=5)
    assert [s.code for s in st] == [ErrorCode.OK, ErrorCode.OK, ErrorCode.OUT_OF_BOUNDS,
                                    ErrorCode.OUT_OF_BOUNDS, ErrorCode.BUFFER_OVERFLOW,
                                    ErrorCode.OK, ErrorCode.OK]
    assert all(s.transport == transport for i, s in enumerate(st) if i not in (2, 3, 4))
    arr = seg.array()
    for off, want in ((0, src[0]), (4096, src[1]), (12288, frozen), (16384, src[3])):
        assert np.array_equal(arr[off:off + 4096], want.array if hasattr(want, "array")
                              else want)
    assert not arr[8192:12288].any()  # the refused write left nothing behind
    # READs alike: into the read-only buffer is refused, the others land
    dst = [e.register_buffer(np.zeros(4096, np.uint8)) for _ in range(2)]
    st = e.run([TransferRequest(R, dst[0], seg.segment_id, 0, 4096),
                TransferRequest(R, ro, seg.segment_id, 4096, 4096),
                TransferRequest(R, dst[1], seg.segment_id, 16384, 4096)], 5.0)
    assert [s.code for s in st] == [ErrorCode.OK, ErrorCode.INVALID_PARAMS, ErrorCode.OK]
    assert st[1].state is RequestState.FAILED and st[1].errors
    assert np.array_equal(dst[0].array, src[0].array)
    assert np.array_equal(dst[1].array, src[3].array)


def test_unavailable_transport_hint_fails_cleanly(make_engine: Any, make_segment: Any) -> None:
    e = make_engine()
    seg = make_segment(4096)
    e.add_local_segment(seg)
    st = e.transfer([TransferRequest(W, b"abc", seg.segment_id, 0, 3, transport="rdma")], 5)
    assert st[0].state is RequestState.FAILED
    assert st[0].code == ErrorCode.TRANSPORT_UNAVAILABLE
    assert "rdma" in st[0].errors[0]


def test_mixed_batch_splits_into_sub_batches(make_engine: Any, make_segment: Any) -> None:
    e = make_engine()
    seg = make_segment(1 << 20)
    e.add_local_segment(seg)
    src = _pattern(1 << 20)
    reqs = [TransferRequest(W, src, seg.segment_id, i * 4096, 4096, buffer_offset=i * 4096,
                            transport="tcp" if i % 2 else None) for i in range(64)]
    h = e.submit(reqs)
    assert h.wait(10) and h.ok
    st = h.status()
    assert {s.transport for s in st[0::2]} == {"shm"}
    assert {s.transport for s in st[1::2]} == {"tcp"}
    assert sorted(sb.transport for sb in h.sub_batches) == ["shm", "tcp"]
    assert all(sb.state is SubBatchState.DONE for sb in h.sub_batches)
    assert (seg.array()[: 64 * 4096] == src[: 64 * 4096]).all()


def test_failing_transport_fails_over_other_sub_batch_untouched(make_engine: Any,
                                                                make_segment: Any) -> None:
    _register_fake("flaky")
    e = make_engine(overrides={"rules": [
        {"name": "small", "kind": "memory", "max_size": 8192, "transports": ["flaky", "tcp"]},
        {"name": "big", "kind": "memory", "transports": ["shm"]},
    ]})
    flaky = FlakyTransport(delay=0.05)
    e.register_transport(flaky)
    seg = make_segment(1 << 20)
    e.add_local_segment(seg)
    src = _pattern(1 << 20)
    reqs = [TransferRequest(W, src, seg.segment_id, 0, 4096),            # flaky -> tcp
            TransferRequest(W, src, seg.segment_id, 65536, 65536, buffer_offset=65536),  # shm
            TransferRequest(W, src, seg.segment_id, 8192, 8192, buffer_offset=8192)]     # flaky
    h = e.submit(reqs)
    assert h.wait(10)
    st = h.status()
    assert [s.state for s in st] == [RequestState.DONE] * 3
    assert [s.transport for s in st] == ["tcp", "shm", "tcp"]
    assert st[0].errors and st[0].errors[0].startswith("flaky:")
    assert st[1].errors == []
    by_t = {sb.transport: sb for sb in h.sub_batches}
    assert by_t["flaky"].state is SubBatchState.FAILED and by_t["flaky"].failed == 2
    assert by_t["shm"].state is SubBatchState.DONE and by_t["shm"].done == 1
    a = seg.array()
    assert (a[:4096] == src[:4096]).all() and (a[8192:16384] == src[8192:16384]).all()
    assert (a[65536:131072] == src[65536:131072]).all()
    assert flaky.calls == 1
    # the node metrics' counters: each slice made once per transport, the
    # failures and failovers, and the tcp writes served by this engine's own server
    c = e.counters
    assert c.failures == {"flaky": 2} and c.failovers == {"flaky": 2}
    cells = {(x.direction, x.transport): x for x in c.snapshot() if x.op is W}
    made = {t: (x.requests, x.bytes, x.count) for (d, t), x in cells.items()
            if d is Direction.MADE}
    assert made == {"flaky": (2, 12288, 1), "tcp": (2, 12288, 1), "shm": (1, 65536, 1)}
    assert all(x.buckets[-1] == x.count and x.sum_s > 0 for x in cells.values())

    def served() -> tuple[int, int]:  # recorded after the reply went out: may trail it
        got = [x for x in c.snapshot() if x.direction is Direction.SERVED]
        return sum(x.requests for x in got), sum(x.bytes for x in got)

    wait_until(lambda: served() == (2, 12288), 5, "the served writes counted")


def test_max_failover_zero_and_pause_after_failures(make_engine: Any,
                                                    make_segment: Any) -> None:
    _register_fake("flaky")
    e = make_engine(overrides={
        "max_failover": 0,
        "rules": [{"name": "all", "transports": ["flaky", "shm"]}],
        "transports": {"flaky": {"pause_after_failures": 2, "cooldown_s": 30}},
    })
    from kvpool.transfer.config import TransportSettings

    settings = TransportSettings(pause_after_failures=2, cooldown_s=30)
    settings.validate()
    flaky = FlakyTransport()
    e.register_transport(flaky, settings)
    seg = make_segment(4096)
    e.add_local_segment(seg)
    for _ in range(2):
        st = e.transfer([TransferRequest(W, b"abcd", seg.segment_id, 0, 4)], 5)
        assert st[0].state is RequestState.FAILED and st[0].transport == "flaky"
        assert st[0].code == ErrorCode.TRANSFER_FAIL
    # paused now: the selector skips it and shm serves the request
    st = e.transfer([TransferRequest(W, b"abcd", seg.segment_id, 0, 4)], 5)
    assert st[0].ok and st[0].transport == "shm" and st[0].errors == []
    assert flaky.calls == 2


def test_retries_on_same_transport(make_engine: Any, make_segment: Any) -> None:
    _register_fake("flaky")
    e = make_engine(overrides={"rules": [{"name": "all", "transports": ["flaky", "shm"]}]})
    from kvpool.transfer.config import TransportSettings

    s = TransportSettings(retries=2)
    s.validate()
    flaky = FlakyTransport()
    e.register_transport(flaky, s)
    seg = make_segment(4096)
    e.add_local_segment(seg)
    st = e.transfer([TransferRequest(W, b"abcd", seg.segment_id, 0, 4)], 5)
    assert st[0].ok and st[0].transport == "shm"
    assert flaky.calls == 3 and len(st[0].errors) == 3


class ScriptedTransport(FlakyTransport):
    """Test-only transport: each call does the next step of ``plan`` ("ok":
    copies the bytes; "fail": a retryable failure; "odd": that failure for
    the requests of odd index only; "crash": raises), "ok" once the plan is
    used up; records the thread and the request indices of each call."""

    name = "scripted"

    def __init__(self, plan: list[str]) -> None:
        super().__init__()
        self.plan = plan
        self.threads: list[threading.Thread] = []
        self.batches: list[list[int]] = []

    def execute(self, items: Sequence[WorkItem], deadline: float, report: ReportFn) -> None:
        self.calls += 1
        self.threads.append(threading.current_thread())
        self.batches.append([it.index for it in items])
        step = self.plan.pop(0) if self.plan else "ok"
        if step == "crash":
            raise RuntimeError("scripted crash")
        for it in items:
            if step == "fail" or (step == "odd" and it.index % 2):
                report(it, TransferError("scripted failure", ErrorCode.TRANSFER_FAIL))
                continue
            assert it.local is not None and it.op is W
            it.local.array()[it.offset:it.offset + it.length] = \
                it.buffer.host_view(it.buffer_offset, it.length)
            report(it, None)


def _scripted_engine(make_engine: Any, make_segment: Any) -> tuple[Any, ScriptedTransport, Any]:
    """An engine trying the scripted transport first, then shm (retries 1, a
    pause after 3 failures), and a 1 MiB local segment."""
    _register_fake("scripted")
    from kvpool.transfer.config import TransportSettings

    e = make_engine(overrides={"rules": [{"name": "all", "transports": ["scripted", "shm"]}]})
    s = TransportSettings(retries=1, pause_after_failures=3, cooldown_s=30)
    s.validate()
    t = ScriptedTransport([])
    e.register_transport(t, s)
    seg = make_segment(1 << 20)
    e.add_local_segment(seg)
    return e, t, seg


def test_lone_request_runs_on_the_caller_thread_with_batch_semantics(
        make_engine: Any, make_segment: Any) -> None:
    """A lone request runs on the caller's thread; a failed or crashed first
    attempt goes on as in a batch (retries, failover, error list, codes), and a
    success clears the peer's failure count as a batch's does."""
    e, t, seg = _scripted_engine(make_engine, make_segment)
    src = _pattern(1 << 20, seed=5)

    def put(off: int, n: int) -> Any:
        return e.transfer([TransferRequest(W, src, seg.segment_id, off, n, buffer_offset=off)],
                          5)[0]

    st = put(0, 4096)
    assert st.ok and st.transport == "scripted" and st.errors == [] and st.code == ErrorCode.OK
    assert t.threads == [threading.current_thread()]
    assert seg.array()[:4096].tobytes() == src[:4096].tobytes()
    st = e.run([TransferRequest(W, src, seg.segment_id, 4096, 4096, buffer_offset=4096)], 5)[0]
    assert st.ok and st.transport == "scripted" and t.threads[-1] is threading.current_thread()
    # a failed first attempt is retried on the same transport (retries: 1)
    t.plan[:] = ["fail"]
    t.calls = 0
    st = put(8192, 8192)
    assert st.ok and st.transport == "scripted" and t.calls == 2, st
    assert len(st.errors) == 1 and st.errors[0] == "scripted: [TRANSFER_FAIL] scripted failure"
    assert seg.array()[8192:16384].tobytes() == src[8192:16384].tobytes()
    # a crash, twice: counted as failures, then failover to shm
    t.plan[:] = ["crash", "crash"]
    st = put(65536, 4096)
    assert st.ok and st.transport == "shm", st
    assert len(st.errors) == 2 and all("RuntimeError: scripted crash" in x for x in st.errors)
    assert seg.array()[65536:69632].tobytes() == src[65536:69632].tobytes()
    # two failed attempts towards the pause (3 needed); a success clears them
    t.plan[:] = ["ok"]
    assert put(0, 4096).transport == "scripted"
    t.plan[:] = ["fail", "fail"]
    st = put(0, 4096)
    assert st.ok and st.transport == "shm" and len(st.errors) == 2
    # two failed attempts since the success (four without it): not paused
    t.plan[:] = []
    assert put(0, 4096).transport == "scripted"
    # a final refusal is not retried: an out-of-bounds request fails at once
    st = e.transfer([TransferRequest(W, src, seg.segment_id, (1 << 20) - 8, 16)], 5)[0]
    assert st.state is RequestState.FAILED and st.code == ErrorCode.OUT_OF_BOUNDS, st


def test_alike_batch_runs_inline_and_hands_failures_to_the_batch_path(
        make_engine: Any, make_segment: Any) -> None:
    """A batch of requests alike (one segment, registered buffers, one length)
    runs its first attempt on the caller's thread in one call of the
    transport; requests that fail in it go on as in any batch (retried alone
    on the same transport, then failover, every error listed), the others are
    DONE once; batches that are not alike and invalid requests take the
    general path with its codes."""
    e, t, seg = _scripted_engine(make_engine, make_segment)
    src = _pattern(1 << 20, seed=7)
    buf = e.register_buffer(src)
    fail = "scripted: [TRANSFER_FAIL] scripted failure"

    def reqs(base: int, n: int = 8, size: int = 4096) -> list[TransferRequest]:
        return [TransferRequest(W, buf, seg.segment_id, base + k * size, size,
                                buffer_offset=base + k * size) for k in range(n)]

    def landed(base: int, n: int = 8, size: int = 4096) -> bool:
        end = base + n * size
        return seg.array()[base:end].tobytes() == src[base:end].tobytes()

    st = e.transfer(reqs(0), 5)
    assert [(x.ok, x.transport, x.errors, x.code) for x in st] == \
        [(True, "scripted", [], ErrorCode.OK)] * 8
    # one read-only status object for the requests served at once
    assert len({id(x) for x in st}) == 1
    with pytest.raises(AttributeError):
        st[0].code = ErrorCode.TRANSFER_FAIL  # type: ignore[misc]
    assert t.threads == [threading.current_thread()] and t.batches == [list(range(8))]
    assert landed(0)
    st = e.run(reqs(32768), 5)
    assert all(x.ok and x.transport == "scripted" for x in st) and landed(32768)
    assert t.threads[-1] is threading.current_thread()
    # the odd ones fail in the first attempt: only they are tried again
    t.plan[:] = ["odd"]
    t.batches.clear()
    st = e.transfer(reqs(65536), 5)
    assert all(x.ok and x.transport == "scripted" for x in st), st
    assert [x.errors for x in st] == [[], [fail]] * 4
    assert t.batches == [list(range(8)), [1, 3, 5, 7]]
    assert landed(65536)
    # a crash, twice: every request fails over to shm with both errors listed
    t.plan[:] = ["crash", "crash"]
    st = e.run(reqs(131072), 5)
    assert all(x.ok and x.transport == "shm" for x in st), st
    assert all(len(x.errors) == 2 and all("RuntimeError: scripted crash" in m
                                          for m in x.errors) for x in st)
    assert landed(131072)
    # not alike (two lengths): the general path, the same result
    t.batches.clear()
    mixed = reqs(262144, 2) + reqs(262144 + 8192, 2, 8192)
    st = e.transfer(mixed, 5)
    assert all(x.ok and x.transport == "scripted" for x in st) and landed(262144, 3, 8192)
    # an invalid request in a batch: its own code, the others DONE
    bad = reqs(327680, 4)
    bad[2] = TransferRequest(W, buf, seg.segment_id, (1 << 20) - 8, 4096)
    st = e.transfer(bad, 5)
    assert [x.state for x in st] == [RequestState.DONE] * 2 + [RequestState.FAILED] + \
        [RequestState.DONE]
    assert st[2].code == ErrorCode.OUT_OF_BOUNDS, st
    # a batch that fails on its first transport, retried there (retries: 1), fails
    # over to shm with both errors listed
    t.plan[:] = ["fail", "fail"]
    t.batches.clear()
    st = e.transfer(reqs(196608, 4), 5)
    assert all(x.ok and x.transport == "shm" and x.errors == [fail, fail] for x in st), st
    assert t.batches == [[0, 1, 2, 3]] * 2 and landed(196608, 4)


def test_hanging_transport_fails_by_deadline(make_engine: Any, make_segment: Any) -> None:
    _register_fake("hang")
    e = make_engine(overrides={"rules": [{"name": "all", "transports": ["hang", "shm"]}]})
    from kvpool.transfer.config import TransportSettings

    s = TransportSettings(timeout_s=0.5)
    s.validate()
    e.register_transport(HangingTransport(), s)
    seg = make_segment(4096)
    e.add_local_segment(seg)
    t0 = time.monotonic()
    st = e.transfer([TransferRequest(W, b"abcd", seg.segment_id, 0, 4)], 5)
    assert time.monotonic() - t0 < 3
    assert st[0].ok and st[0].transport == "shm"
    assert "without reporting" in st[0].errors[0]


def test_status_progress_while_running(make_engine: Any, make_segment: Any) -> None:
    _register_fake("hang")
    e = make_engine(overrides={"max_failover": 0,
                               "rules": [{"name": "all", "transports": ["hang"]}]})
    from kvpool.transfer.config import TransportSettings

    s = TransportSettings(timeout_s=0.5)
    s.validate()
    e.register_transport(HangingTransport(), s)
    seg = make_segment(4096)
    e.add_local_segment(seg)
    h = e.submit([TransferRequest(W, b"abcd", seg.segment_id, 0, 4)])
    assert not h.wait(0.1)
    assert h.status()[0].state is RequestState.RUNNING
    with pytest.raises(TransferError) as ei:
        e.transfer([TransferRequest(W, b"abcd", seg.segment_id, 0, 4)], timeout=0.1)
    assert ei.value.code == ErrorCode.TIMEOUT
    assert h.wait(5) and h.status()[0].state is RequestState.FAILED


def test_concurrent_batches(make_engine: Any, make_segment: Any) -> None:
    e = make_engine()
    seg = make_segment(1 << 20)
    e.add_local_segment(seg)
    errors: list[str] = []

    def worker(k: int) -> None:
        src = _pattern(4096, seed=k)
        dst = np.zeros(4096, np.uint8)
        t = "tcp" if k % 2 else "shm"
        for _ in range(20):
            st = e.transfer([TransferRequest(W, src, seg.segment_id, k * 4096, 4096, transport=t),
                             ], 5)
            st += e.transfer([TransferRequest(R, dst, seg.segment_id, k * 4096, 4096,
                                              transport=t)], 5)
            if not all(s.ok for s in st) or not (dst == src).all():
                errors.append(f"worker {k}: {st}")
                return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


def test_submit_after_close_raises(make_engine: Any) -> None:
    e = make_engine()
    e.close()
    with pytest.raises(TransferError) as ei:
        e.submit([])
    assert ei.value.code == ErrorCode.CLOSED


def test_gpu_buffer_without_cuda_fails_with_reason(make_engine: Any, make_segment: Any) -> None:
    from kvpool.transfer.gpu import cuda_available

    if cuda_available()[0]:
        pytest.skip("a CUDA device is present: covered by tests/transfer/test_gpu.py")
    e = make_engine()
    seg = make_segment(4096)
    e.add_local_segment(seg)
    fake_dev = e.register_buffer((0x7F0000000000, 4096), device="cuda")
    st = e.transfer([TransferRequest(R, fake_dev, seg.segment_id, 0, 4096)], 5)
    assert st[0].state is RequestState.FAILED
    assert st[0].code == ErrorCode.TRANSPORT_UNAVAILABLE
    assert "no CUDA device" in st[0].errors[0]


def test_background_prefault_keeps_data_written_meanwhile(make_engine: Any) -> None:
    import os

    from kvpool.transfer import MemorySegment

    seg = MemorySegment.create("bg", 256 << 20, prefault="background")
    try:
        e = make_engine()
        e.add_local_segment(seg)
        src = _pattern(1 << 20, seed=4)
        offs = [0, 100 << 20, (256 << 20) - (1 << 20)]
        for off in offs:  # races the prefault thread on purpose
            assert e.transfer([TransferRequest(W, src, seg.segment_id, off, 1 << 20)], 5)[0].ok
        assert seg.prefault_done.wait(30)
        for off in offs:
            assert (seg.array()[off:off + (1 << 20)] == src).all()
        st = os.stat(os.path.join("/dev/shm", seg.name))
        assert st.st_blocks * 512 >= 256 << 20  # every page allocated
    finally:
        seg.close()
    with pytest.raises(TransferError):
        MemorySegment.create("bad", 4096, prefault="sometimes")
