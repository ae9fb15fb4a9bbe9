"""Failure paths of the store client's put/get fast paths, against a real master
and real node daemons: a holder killed with SIGKILL makes every write to it and
every read from it fail (tcp forced, so no same-host shm copy can reach its
orphaned file). Failed writes are revoked (the key is absent and can be put
again); batch calls report per-key codes for a mixed batch."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.store import Client, ReplicateConfig
from kvpool.store.errors import TransferFailed

pytestmark = pytest.mark.timeout(120)

# every copy over tcp (a killed holder's /dev/shm file would still be mapped inline)
FORCE_TCP = {"rules": [{"name": "test-force-tcp", "transports": ["tcp"]}],
             "transports": {"tcp": {"timeout_s": 1.0, "retries": 0}}}
K = 64 << 10


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    """This module's master: a killed holder stays mounted (its client TTL is
    far longer than the tests), so the master keeps placing replicas on it."""
    d = tmp_path_factory.mktemp("master")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=5000, client_ttl_s=120) as m:
        yield m


@pytest.fixture
def doomed(master: MasterProcess) -> Iterator[NodeDaemonProcess]:
    """A holder with room for four values of K bytes, killed by the test. No
    guard process: a guard would unmount its segment right after the kill,
    and a put racing that unmount would be placed on a live holder instead."""
    with NodeDaemonProcess(master.address, "256KiB", extra_args=["--no-guard"]) as d:
        yield d


@contextlib.contextmanager
def _killed_keeping_segment(c: Client, d: NodeDaemonProcess) -> Iterator[None]:
    """kill -9 ``d`` with its segment left mounted for the test: a thread of
    the test waits for the lock of its /dev/shm file and takes it over as the
    owner dies, so the janitor of a live daemon on this host (every 2 s) does
    not reap the file and unmount the segment at the master midway, which
    would place the test's puts on a live holder. The lock is dropped when
    the block ends (the file is reaped then)."""
    names = {s.descriptor.name for s in c.list_segments()
             if s.descriptor.segment_id in d.segment_ids}
    assert names, "the doomed daemon's segment is not listed"
    fds = [os.open(os.path.join("/dev/shm", n), os.O_RDONLY) for n in names]
    waiters = [threading.Thread(target=fcntl.flock, args=(fd, fcntl.LOCK_EX), daemon=True)
               for fd in fds]
    try:
        for t in waiters:
            t.start()
        d.kill()
        for t in waiters:
            t.join(10)
            assert not t.is_alive(), "the dead daemon's segment lock was not released"
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _vals(n: int, seed: int, size: int = K) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("checksum", ["none", "crc32"])
def test_batch_put_mixed_codes_and_failed_writes_revoked(
        daemons: list[NodeDaemonProcess], doomed: NodeDaemonProcess,
        make_client: Callable[..., Client], checksum: str) -> None:
    """One batch: keys placed on a dead holder fail (TRANSFER_FAIL, revoked),
    the rest land; an invalid key, a repeat and an existing key get their own
    codes. The fast key checks (no checksum) and the per-key ones agree."""
    c = make_client(transfer_overrides=FORCE_TCP, checksum=checksum)
    dead = doomed.segment_ids[0]
    tag = uuid.uuid4().hex[:8]
    keys = [f"{tag}/w{i}" for i in range(8)]
    vals = _vals(8, 1)
    c.put(f"{tag}/old", b"old")
    with _killed_keeping_segment(c, doomed):
        # the dead holder is tried first; once its 256 KiB are taken the rest go elsewhere
        codes = c.batch_put_from(keys, vals, ReplicateConfig(preferred_segments=[dead]))
    assert set(codes) == {ErrorCode.OK, ErrorCode.TRANSFER_FAIL}, codes
    failed = [k for k, code in zip(keys, codes, strict=True) if code]
    landed = [i for i, code in enumerate(codes) if not code]
    assert c.batch_exists(keys) == [not code for code in codes]
    for i in landed:
        assert c.get(keys[i]) == vals[i].tobytes()
    # revoked, not left half-written: the same keys go in again elsewhere
    live = [s for d in daemons for s in d.segment_ids]
    again = c.batch_put_from(failed, vals[:len(failed)],
                             ReplicateConfig(preferred_segments=live))
    assert again == [ErrorCode.OK] * len(failed)
    # non-transfer codes, per key, next to a dead-holder write in one batch
    mixed = [f"{tag}/m0", "", f"{tag}/m0", f"{tag}/old", f"{tag}/m1"]
    codes = c.batch_put_from(mixed, _vals(5, 2), ReplicateConfig(preferred_segments=[dead]))
    assert codes[1:4] == [ErrorCode.INVALID_KEY, ErrorCode.OBJECT_ALREADY_EXISTS,
                          ErrorCode.OBJECT_ALREADY_EXISTS]
    assert {codes[0], codes[4]} <= {ErrorCode.OK, ErrorCode.TRANSFER_FAIL}
    assert c.batch_exists([mixed[0], mixed[4]]) == [not codes[0], not codes[4]]


def test_single_put_to_dead_holder_is_revoked(daemons: list[NodeDaemonProcess],
                                              doomed: NodeDaemonProcess,
                                              make_client: Callable[..., Client]) -> None:
    c = make_client(transfer_overrides=FORCE_TCP)
    dead = doomed.segment_ids[0]
    k = f"{uuid.uuid4().hex[:8]}/single"
    (v,) = _vals(1, 3)
    with _killed_keeping_segment(c, doomed), pytest.raises(TransferFailed):
        c.put_from(k, v, ReplicateConfig(preferred_segments=[dead]))
    assert not c.exists(k)
    live = daemons[0].segment_ids[0]
    c.put_from(k, v, ReplicateConfig(preferred_segments=[live]))
    assert c.get(k) == v.tobytes()


def test_batch_get_mixed_codes_after_holder_dies(daemons: list[NodeDaemonProcess],
                                                 doomed: NodeDaemonProcess,
                                                 make_client: Callable[..., Client]) -> None:
    """Keys whose only replica is on a dead holder read as TRANSFER_FAIL, the
    others are read whole; missing keys and small buffers keep their codes."""
    c = make_client(transfer_overrides=FORCE_TCP)
    dead, live = doomed.segment_ids[0], daemons[0].segment_ids[0]
    tag = uuid.uuid4().hex[:8]
    vals = _vals(4, 4)
    keys = [f"{tag}/r{i}" for i in range(4)]
    assert c.batch_put_from(keys[:2], vals[:2], ReplicateConfig(preferred_segments=[live])) \
        == [ErrorCode.OK] * 2
    assert c.batch_put_from(keys[2:], vals[2:], ReplicateConfig(preferred_segments=[dead])) \
        == [ErrorCode.OK] * 2
    doomed.kill()
    dst = [np.zeros(K, np.uint8) for _ in range(5)] + [np.zeros(10, np.uint8)]
    res = c.batch_get_into([keys[0], keys[2], keys[1], keys[3], f"{tag}/none", keys[0]], dst)
    assert res == [K, ErrorCode.TRANSFER_FAIL, K, ErrorCode.TRANSFER_FAIL,
                   ErrorCode.OBJECT_NOT_FOUND, ErrorCode.BUFFER_OVERFLOW]
    assert np.array_equal(dst[0], vals[0]) and np.array_equal(dst[2], vals[1])
    assert c.get_batch([keys[1], keys[3]]) == [vals[1].tobytes(), None]
