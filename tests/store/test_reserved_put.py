"""Single puts through reservations (ClientConfig.reserve_single_puts), against a
real master and real node daemons: a commit's reply hands the client a
reservation of the put's size; the next put of that size writes into it and
sends one PUT_COMMIT. Every path that cannot use a reservation (expired, its
holder dead, the key taken) must store the bytes as a plain put would, or fail
as it would, and leave nothing pending."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import (
    Exist,
    GetReplicaList,
    PutCommit,
    PutEnd,
    PutRevoke,
    PutStart,
)
from kvpool.store import Client, ReplicateConfig
from kvpool.store.errors import AlreadyExists, ObjectNotFound, StoreError, TransferFailed
from support import reserving
from support.factories import client_factory
from support.reserving import held, pending, spares, spy_requests
from support.threads import run_in_threads

pytestmark = pytest.mark.timeout(120)

# a master, one node daemon and clients per test (overriding tests/store/conftest.py's)
master, live, make_client = reserving.master, reserving.live, reserving.make_client

FORCE_TCP = {"rules": [{"name": "test-force-tcp", "transports": ["tcp"]}],
             "transports": {"tcp": {"timeout_s": 1.0, "retries": 0}}}
K = 4096


def _val(seed: int, size: int = K) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_second_put_is_one_master_call(make_client: Callable[..., Client]) -> None:
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    vals = [_val(i) for i in range(4)]
    sent = spy_requests(c)
    c.put_from(f"{tag}/0", vals[0])
    assert sent == ["PutStart", "PutEnd"]  # the first: a plain put, asking for a reservation
    first = spares(c)[K][-1].placeholders[0]
    sent.clear()
    c.put_from(f"{tag}/1", vals[1])
    assert sent == ["PutCommit"]
    second = spares(c)[K][-1].placeholders[0]
    assert second != first
    sent.clear()
    c.put(f"{tag}/2", vals[2].tobytes())  # the reservation of the second's reply
    assert sent == ["PutCommit"]
    assert spares(c)[K][-1].placeholders[0] != second
    for i in range(3):
        assert c.get(f"{tag}/{i}") == vals[i].tobytes()
    # another size: its own reservation, next to the first
    big = _val(9, 3 * K)
    c.put_from(f"{tag}/big0", big)
    sent.clear()
    c.put_from(f"{tag}/big1", big)
    assert sent == ["PutCommit"] and sorted(spares(c)) == [K, 3 * K]
    assert [len(v) for v in spares(c).values()] == [1, 1]  # one used, one granted
    assert c.get(f"{tag}/big1") == big.tobytes()
    # a non-default put takes the plain path and leaves the reservations alone
    sent.clear()
    c.put_from(f"{tag}/pinned", vals[3], ReplicateConfig(with_hard_pin=True))
    assert sent == ["PutStart", "PutEnd"]
    assert c.get(f"{tag}/pinned") == vals[3].tobytes()


def test_reserve_max_bytes_bounds_each_put_and_what_is_held(
        make_client: Callable[..., Client]) -> None:
    """A put of up to ``reserve_max_bytes`` reserves (a 1 MiB put is one master
    call the second time); a larger one never does; a client holds below 4x
    the bound in all: a put that would pass it asks for none, until a held one
    is used."""
    mib = 1 << 20
    c = make_client(reserve_max_bytes=mib)
    cache = c._parts.writes.spares
    tag = uuid.uuid4().hex[:8]
    big = _val(5, mib)
    sent = spy_requests(c)
    c.put_from(f"{tag}/m0", big)
    c.put_from(f"{tag}/m1", big)
    assert sent == ["PutStart", "PutEnd", "PutCommit"]
    assert c.get(f"{tag}/m0") == big.tobytes() and c.get(f"{tag}/m1") == big.tobytes()
    sent.clear()
    over = _val(6, mib + K)
    c.put_from(f"{tag}/o0", over)
    c.put_from(f"{tag}/o1", over)
    assert sent == ["PutStart", "PutEnd"] * 2 and mib + K not in spares(c)
    assert c.get(f"{tag}/o1") == over.tobytes()
    sizes = [mib - K * i for i in range(1, 5)]
    for size in sizes:
        c.put_from(f"{tag}/s{size}", _val(size, size))
    # held: 1 MiB and three of the sizes (4 MiB - 6 KiB); a fourth would pass 4 MiB
    assert sorted(spares(c)) == sorted([mib, *sizes[:3]])
    assert cache.held_bytes == mib + sum(sizes[:3]) <= 4 * mib
    sent.clear()
    v = _val(7, sizes[3])
    c.put_from(f"{tag}/t", v)
    assert sent == ["PutStart", "PutEnd"] and sizes[3] not in spares(c)
    sent.clear()
    c.put_from(f"{tag}/u", big)  # uses the 1 MiB one: room again, so it asks for the next
    assert sent == ["PutCommit"] and len(spares(c)[mib]) == 1
    assert cache.held_bytes == mib + sum(sizes[:3])
    assert c.get(f"{tag}/t") == v.tobytes() and c.get(f"{tag}/u") == big.tobytes()
    c.close()
    assert cache.held_bytes == 0


def test_expired_reservation_is_given_back(make_client: Callable[..., Client]) -> None:
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    c.put_from(f"{tag}/a", _val(1))
    held = spares(c)[K][-1]
    held.deadline = time.monotonic() - 1.0  # its ttl ran out
    sent = spy_requests(c)
    v = _val(2)
    c.put_from(f"{tag}/b", v)
    assert sent == ["PutRevoke", "PutStart", "PutEnd"]
    assert c.get(f"{tag}/b") == v.tobytes()
    assert spares(c)[K][-1].placeholders[0] != held.placeholders[0]
    # the master no longer holds the expired one
    with pytest.raises(ObjectNotFound):
        c._parts.session.call(PutCommit(c.client_id, held.placeholders[0], f"{tag}/c"))


def test_taken_key_keeps_the_reservation(make_client: Callable[..., Client]) -> None:
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    old, new = _val(3), _val(4)
    c.put_from(f"{tag}/k", old)
    held = spares(c)[K][-1].placeholders[0]
    sent = spy_requests(c)
    with pytest.raises(AlreadyExists):
        c.put_from(f"{tag}/k", new)
    assert sent == ["PutCommit"]
    assert c.get(f"{tag}/k") == old.tobytes()  # unchanged
    assert spares(c)[K][-1].placeholders[0] == held  # still reserved, still usable
    sent.clear()
    c.put_from(f"{tag}/other", new)
    assert sent == ["PutCommit"]
    assert c.get(f"{tag}/other") == new.tobytes()


def test_close_gives_reservations_back(make_client: Callable[..., Client]) -> None:
    watcher = make_client()
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    before = pending(watcher)
    for size in (K, 2 * K, 5 * K):
        c.put_from(f"{tag}/{size}", _val(size, size))
    assert pending(watcher) == before + 3
    c.close()
    assert pending(watcher) == before


def test_reserved_namespace_refused(make_client: Callable[..., Client]) -> None:
    c = make_client()
    other = make_client()
    tag = uuid.uuid4().hex[:8]
    for bad in ("\x00resv/x", "\x00"):
        with pytest.raises(StoreError) as err:
            c.put(bad, b"x")
        assert err.value.code == ErrorCode.INVALID_KEY
    c.put_from(f"{tag}/a", _val(5))
    placeholder = spares(c)[K][-1].placeholders[0]
    assert placeholder.startswith("\x00")
    # the master refuses the namespace itself, whoever sends it: no commit of a
    # placeholder as an object, no read of one, no plain put into it
    for req in (PutEnd(c.client_id, placeholder), GetReplicaList(placeholder),
                Exist(placeholder), PutStart(c.client_id, "\x00resv/y", 8),
                PutCommit(c.client_id, placeholder, "\x00resv/z")):
        with pytest.raises(StoreError) as err:
            c._parts.session.call(req)
        assert err.value.code == ErrorCode.INVALID_KEY, req
    # another client cannot use or revoke it
    with pytest.raises(ObjectNotFound):
        other._parts.session.call(PutCommit(other.client_id, placeholder, f"{tag}/stolen"))
    with pytest.raises(StoreError) as err:
        other._parts.session.call(PutRevoke(other.client_id, placeholder))
    assert err.value.code == ErrorCode.INVALID_WRITE
    assert not c.exists(f"{tag}/stolen")
    v = _val(6)
    c.put_from(f"{tag}/b", v)  # the owner still can
    assert c.get(f"{tag}/b") == v.tobytes()


def test_threads_putting_one_size(make_client: Callable[..., Client]) -> None:
    """Threads racing for the reservations of one size: each reservation is
    used by one put at most, every value reads back whole, and close() leaves
    nothing pending."""
    watcher = make_client()
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    before = pending(watcher)

    def worker(t: int) -> None:
        for i in range(25):
            c.put_from(f"{tag}/{t}/{i}", _val(100 * t + i))

    run_in_threads(worker, 4, 60)
    for t in range(4):
        for i in range(25):
            assert c.get(f"{tag}/{t}/{i}") == _val(100 * t + i).tobytes()
    n = held(c)
    assert 1 <= n <= 4
    assert pending(watcher) == before + n
    c.close()
    assert pending(watcher) == before


def test_holder_killed_under_a_reservation(master: MasterProcess, live: NodeDaemonProcess,
                                           make_client: Callable[..., Client]) -> None:
    """(Last in this module: the dead holder stays mounted.) The reservation
    lies on a holder killed -9 (no guard): its write fails,
    it is revoked and the put is done from the start, failing as a plain put
    to that holder does (the master still places there); once placed on a live
    holder, the bytes land. Nothing stays pending."""
    watcher = make_client()
    with NodeDaemonProcess(master.address, "256MiB", extra_args=["--no-guard"]) as doomed:
        c = make_client(transfer_overrides=FORCE_TCP)
        tag = uuid.uuid4().hex[:8]
        before = pending(watcher)
        c.put_from(f"{tag}/a", _val(7))
        held = spares(c)[K][-1]
        assert held.replicas[0].segment_id == doomed.segment_ids[0]  # the most free
        doomed.kill()
        sent = spy_requests(c)
        v = _val(8)
        with pytest.raises(TransferFailed):
            c.put_from(f"{tag}/b", v)
        assert sent[0] == "PutRevoke" and sent[1:] == ["PutStart", "PutRevoke"]
        assert not c.exists(f"{tag}/b") and not spares(c)
        assert pending(watcher) == before
        c.put_from(f"{tag}/b", v, ReplicateConfig(preferred_segments=live.segment_ids))
        assert c.get(f"{tag}/b") == v.tobytes()



_HOLDING_CLIENT = """
import sys, time
import numpy as np
from kvpool.store import Client, ClientConfig
c = Client(ClientConfig(master_address=sys.argv[1], rpc_timeout_s=5.0))
c.setup()
for size in (4096, 8192, 20480):
    c.put_from(f"{sys.argv[2]}/{size}",
               np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
print(sum(len(x.placeholders) for g in c._parts.writes.spares.by_size.values()
          for x in g), flush=True)
time.sleep(300)  # until killed
"""


def test_a_reservation_never_evicts_what_is_stored(tmp_path: Any) -> None:
    """Space held ahead for a client's next put is taken only where it is
    free below the memory pool's high watermark (90% of 32 MiB here): a
    12 MiB put is granted a 12 MiB reservation while both fit, the next one
    writes into it and is refused another (it would evict the first value),
    and every value stays readable."""
    mib = 1 << 20
    with MasterProcess(data_dir=str(tmp_path)) as m, NodeDaemonProcess(m.address, "32MiB"), \
            client_factory(m.address, rpc_timeout_s=5.0) as make:
        c = make()
        a, b = _val(21, 12 * mib), _val(22, 12 * mib)
        sent = spy_requests(c)
        c.put_from("a", a)
        assert sent == ["PutStart", "PutEnd"] and len(spares(c)[12 * mib]) == 1
        sent.clear()
        c.put_from("b", b)  # into the reservation; 24 MiB used, no room for another
        assert sent == ["PutCommit"] and 12 * mib not in spares(c)
        assert c.get("a") == a.tobytes() and c.get("b") == b.tobytes()
        assert c.stats().pending == 0
        # a small put still reserves where there is room
        c.put_from("small", _val(23))
        assert len(spares(c)[K]) == 1


def test_client_killed_holding_reservations(tmp_path: Any) -> None:
    """A client process killed -9 while it holds reservations (it never gives
    them back): once the master drops the silent client, its reservations
    are revoked and their memory comes back; the values it committed stay
    whole and readable."""
    import os
    import signal
    import subprocess
    import sys

    with MasterProcess(data_dir=str(tmp_path), lease_ttl_ms=2000, client_ttl_s=2.0,
                       extra_args=["--put-start-discard-timeout-s", "2",
                                   "--put-start-release-timeout-s", "60"]) as m, \
            NodeDaemonProcess(m.address, "32MiB"), \
            client_factory(m.address, rpc_timeout_s=5.0) as make:
        watcher = make()
        base = watcher.stats()
        tag = uuid.uuid4().hex[:8]
        proc = subprocess.Popen([sys.executable, "-c", _HOLDING_CLIENT, m.address, tag],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            held = int(proc.stdout.readline() or "0")
            assert held == 3  # one reservation per size
            live = watcher.stats()
            assert live.pending == base.pending + 3
            assert live.memory_used > base.memory_used
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # dropped after client_ttl_s; the reservations' space returns once their
        # WRITE grant can no longer be used (the write window, ~7 s here)
        deadline = time.monotonic() + 40
        while watcher.stats().pending != base.pending and time.monotonic() < deadline:
            time.sleep(0.2)
        assert watcher.stats().pending == base.pending
        for size in (4096, 8192, 20480):
            want = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            assert watcher.get(f"{tag}/{size}") == want.tobytes()
            watcher.remove(f"{tag}/{size}", force=True)  # (the read just leased it)
        while watcher.stats().memory_used != base.memory_used \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert watcher.stats().memory_used == base.memory_used
