"""Batch puts through reservations (ClientConfig.reserve_batch_puts), against a
real master and a real node daemon: a batch commit's reply hands the client
reservations of the batch's shape; the next batch put of that size writes into
them and sends one BATCH_PUT_COMMIT. Every key that cannot use its reservation
(expired, the key taken, a write that failed) must end as a plain batch put
would, and nothing stays pending after close()."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import BatchPutCommit, BatchPutEnd
from kvpool.store import Client, ReplicateConfig
from kvpool.store.errors import StoreError
from support import reserving
from support.reserving import pending, spares, spy_requests
from support.threads import run_in_threads

pytestmark = pytest.mark.timeout(120)

# a master, one node daemon and clients per test (overriding tests/store/conftest.py's)
master, live, make_client = reserving.master, reserving.live, reserving.make_client

K = 4096
N = 8


def _vals(seed: int, n: int = N, size: int = K) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _held(c: Client, size: int = K) -> int:
    return sum(len(r.placeholders) for r in spares(c).get(size, []))


def _check(c: Client, keys: list[str], vals: list[np.ndarray]) -> None:
    for k, v in zip(keys, vals, strict=True):
        assert c.get(k) == v.tobytes(), k


def test_second_batch_is_one_master_call(make_client: Callable[..., Client]) -> None:
    watcher = make_client()
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    before = pending(watcher)
    sent = spy_requests(c)
    keys0 = [f"{tag}/0/{i}" for i in range(N)]
    v0 = _vals(0)
    assert c.batch_put_from(keys0, v0) == [ErrorCode.OK] * N
    assert sent == ["BatchPutStart", "BatchPutEnd"]  # the first asks for reservations
    assert _held(c) == N
    first = list(spares(c)[K][-1].placeholders)
    for b in (1, 2):
        sent.clear()
        keys = [f"{tag}/{b}/{i}" for i in range(N)]
        vals = _vals(b)
        assert c.batch_put_from(keys, vals) == [ErrorCode.OK] * N
        assert sent == ["BatchPutCommit"]
        _check(c, keys, vals)
    assert _held(c) == N and not set(first) & set(spares(c)[K][-1].placeholders)
    _check(c, keys0, v0)
    # a smaller batch takes part of the group; the rest stays for the next one
    sent.clear()
    small = _vals(3, 3)
    assert c.batch_put_from([f"{tag}/s/{i}" for i in range(3)], small) == [ErrorCode.OK] * 3
    assert sent == ["BatchPutCommit"]
    _check(c, [f"{tag}/s/{i}" for i in range(3)], small)
    # what was left of the old group and a new one of 3
    assert [len(r.placeholders) for r in spares(c)[K]] == [N - 3, 3]
    # mixed sizes, a non-default config, an upsert: the plain path, reservations untouched
    sent.clear()
    mixed = [*_vals(4, 2), *_vals(5, 1, 2 * K)]
    assert c.batch_put_from([f"{tag}/m/{i}" for i in range(3)], mixed) == [ErrorCode.OK] * 3
    pinned = _vals(6, 2)
    assert c.batch_put_from([f"{tag}/p/{i}" for i in range(2)], pinned,
                            ReplicateConfig(with_hard_pin=True)) == [ErrorCode.OK] * 2
    assert c.batch_put_from([f"{tag}/0/0"], [pinned[0]], upsert=True) == [ErrorCode.OK]
    # (a batch of one key goes as the single-key ops)
    assert sent == ["BatchPutStart", "BatchPutEnd"] * 2 + ["UpsertStart", "PutEnd"]
    _check(c, [f"{tag}/m/{i}" for i in range(3)] + [f"{tag}/p/{i}" for i in range(2)],
           mixed + pinned)
    assert c.get(f"{tag}/0/0") == pinned[0].tobytes()
    assert pending(watcher) == before + _held(c)
    c.close()
    assert pending(watcher) == before


def test_single_puts_leave_a_batchs_group(make_client: Callable[..., Client]) -> None:
    """Batch puts and single puts of one size, interleaved: a single put takes
    the smallest group that holds it (its own group of one once it has
    one), so the group a batch was granted stays whole for the next batch:
    from the third round on, each batch is one BATCH_PUT_COMMIT and each
    single put one PUT_COMMIT, and every value reads back."""
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    sent = spy_requests(c)
    for r in range(5):
        keys = [f"{tag}/{r}/{i}" for i in range(N)]
        vals = _vals(20 + r)
        sent.clear()
        assert c.batch_put_from(keys, vals) == [ErrorCode.OK] * N
        batch_sent = list(sent)
        one = _vals(40 + r, 1)[0]
        sent.clear()
        c.put(f"{tag}/one/{r}", one.tobytes())
        if r >= 2:
            assert (batch_sent, sent) == (["BatchPutCommit"], ["PutCommit"]), r
        _check(c, keys, vals)
        assert c.get(f"{tag}/one/{r}") == one.tobytes()
    c.close()


def test_taken_and_repeated_keys(make_client: Callable[..., Client]) -> None:
    """A key that exists keeps its value (OBJECT_ALREADY_EXISTS) and its
    spare goes back to the cache (still reserved at the master: a later put of
    that size uses it); the others of the batch are stored."""
    watcher = make_client()
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    before = pending(watcher)
    keys = [f"{tag}/{i}" for i in range(N)]
    old = _vals(10)
    assert c.batch_put_from(keys[:N], old) == [ErrorCode.OK] * N
    new = _vals(11)
    fresh = [f"{tag}/new/{i}" for i in range(N)]
    mix = [keys[0], *fresh[1:N - 1], keys[N - 1]]
    sent = spy_requests(c)
    codes = c.batch_put_from(mix, new)
    assert sent == ["BatchPutCommit"]
    assert codes == [ErrorCode.OBJECT_ALREADY_EXISTS, *[ErrorCode.OK] * (N - 2),
                     ErrorCode.OBJECT_ALREADY_EXISTS]
    _check(c, keys, old)  # unchanged
    _check(c, fresh[1:N - 1], new[1:N - 1])
    assert not c.exists(fresh[0]) and not c.exists(fresh[N - 1])
    # a key twice in one batch: the plain path's per-key checks
    codes = c.batch_put_from([f"{tag}/d", f"{tag}/d"], _vals(12, 2))
    assert codes == [ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS]
    assert pending(watcher) == before + _held(c)
    c.close()
    assert pending(watcher) == before


def test_expired_or_lost_reservations(make_client: Callable[..., Client]) -> None:
    """An expired group is given back and the batch put from the start; a
    group the master no longer holds (revoked behind the client's back) makes
    its keys be put from the start too."""
    watcher = make_client()
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    before = pending(watcher)
    assert c.batch_put_from([f"{tag}/a/{i}" for i in range(N)], _vals(20)) == [ErrorCode.OK] * N
    spares(c)[K][-1].deadline = time.monotonic() - 1.0
    sent = spy_requests(c)
    vals = _vals(21)
    assert c.batch_put_from([f"{tag}/b/{i}" for i in range(N)], vals) == [ErrorCode.OK] * N
    assert sent == ["BatchPutRevoke", "BatchPutStart", "BatchPutEnd"]
    _check(c, [f"{tag}/b/{i}" for i in range(N)], vals)
    # the master forgets half of the group (as a failover or the sweep would)
    group = spares(c)[K][-1]
    c._parts.writes.spares.give_back(group.placeholders[: N // 2])
    sent.clear()
    vals = _vals(22)
    keys = [f"{tag}/c/{i}" for i in range(N)]
    assert c.batch_put_from(keys, vals) == [ErrorCode.OK] * N
    assert sent == ["BatchPutCommit", "BatchPutStart", "BatchPutEnd"]
    _check(c, keys, vals)
    assert pending(watcher) == before + _held(c)
    c.close()
    assert pending(watcher) == before


def test_off_by_config(make_client: Callable[..., Client]) -> None:
    c = make_client(reserve_batch_puts=False)
    tag = uuid.uuid4().hex[:8]
    sent = spy_requests(c)
    for b in range(2):
        vals = _vals(30 + b)
        keys = [f"{tag}/{b}/{i}" for i in range(N)]
        assert c.batch_put_from(keys, vals) == [ErrorCode.OK] * N
        assert sent[-2:] == ["BatchPutStart", "BatchPutEnd"]
        _check(c, keys, vals)
    assert not spares(c)


def test_batch_put_commit_refusals(make_client: Callable[..., Client]) -> None:
    """The op itself: another client's or a foreign placeholder is not found,
    columns of different lengths are refused, a reserved key is INVALID_KEY."""
    c = make_client()
    other = make_client()
    tag = uuid.uuid4().hex[:8]
    assert c.batch_put_from([f"{tag}/a/{i}" for i in range(N)], _vals(40)) == [ErrorCode.OK] * N
    ph = spares(c)[K][-1].placeholders
    end = other._parts.session.call(BatchPutCommit(other.client_id, ph[:2],
                                                   [f"{tag}/x", f"{tag}/y"]))
    assert end.codes == [ErrorCode.OBJECT_NOT_FOUND] * 2
    end = c._parts.session.call(BatchPutCommit(c.client_id, ["\x00resv/elsewhere/1", ph[0]],
                                 [f"{tag}/x", "\x00resv/z"]))
    assert end.codes == [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_KEY]
    with pytest.raises(StoreError) as err:
        c._parts.session.call(BatchPutCommit(c.client_id, ph[:1], [f"{tag}/x", f"{tag}/y"]))
    assert err.value.code == ErrorCode.INVALID_PARAMS
    assert not c.exists(f"{tag}/x") and not c.exists(f"{tag}/y")
    # a commit asking for reservations gets at most one per key it commits
    assert not c._parts.session.call(BatchPutEnd(c.client_id, [], K, 10 ** 6)).placeholders
    end = c._parts.session.call(BatchPutEnd(c.client_id, [f"{tag}/a/0", f"{tag}/a/1"], K, 10 ** 6))
    assert end.codes == [0, 0] and len(end.placeholders) == len(end.replicas) == 2
    c._parts.writes.spares.give_back(end.placeholders)


def test_threads_putting_batches(make_client: Callable[..., Client]) -> None:
    """Threads racing for one size's groups: every reservation used by one
    batch at most, every value reads back whole, nothing pending after close."""
    watcher = make_client()
    c = make_client()
    tag = uuid.uuid4().hex[:8]
    before = pending(watcher)

    def worker(t: int) -> None:
        for b in range(10):
            keys = [f"{tag}/{t}/{b}/{i}" for i in range(N)]
            codes = c.batch_put_from(keys, _vals(1000 * t + b))
            assert codes == [ErrorCode.OK] * N, codes

    run_in_threads(worker, 4, 60)
    for t in range(4):
        for b in range(10):
            _check(c, [f"{tag}/{t}/{b}/{i}" for i in range(N)], _vals(1000 * t + b))
    assert 1 <= len(spares(c)[K]) <= 4
    assert pending(watcher) == before + _held(c)
    c.close()
    assert pending(watcher) == before
