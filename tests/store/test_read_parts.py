"""``Client.batch_get_into_parts``: part 0's keys located by their own RPC,
the others' by a second RPC from a helper thread while part 0 moves; edge
cases of that split, against a real master and node daemon."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import BatchGetReplicaList
from kvpool.store import Client
from kvpool.store.errors import MasterUnreachable, StoreError


def _stored(c: Client, key: Callable[[str], str], n: int) -> tuple[list[str], list[bytes]]:
    keys = [key(f"p{i}") for i in range(n)]
    vals = [bytes([i + 1]) * (3000 + i) for i in range(n)]
    for k, v in zip(keys, vals, strict=True):
        c.put(k, v)
    return keys, vals


def test_two_lookups_first_part_first(daemons: Any, make_client: Callable[..., Client],
                                      key: Callable[[str], str]) -> None:
    c = make_client()
    keys, vals = _stored(c, key, 6)
    asked: list[list[str]] = []
    real_call = c._parts.session.call

    def recording(req: Any) -> Any:
        if isinstance(req, BatchGetReplicaList):
            asked.append(list(req.keys))
        return real_call(req)

    c._parts.session.call = recording  # type: ignore[method-assign]
    bufs = [np.zeros(4000, np.uint8) for _ in keys]
    seen: list[tuple[int, list[int]]] = []
    # key 1 is in parts 0 and 1 (read once, reported twice); key 5 in no part
    res = c.batch_get_into_parts(keys, bufs, [[2, 1], [1, 0], [3, 4]],
                                 lambda p, r: seen.append((p, r)))
    assert asked[0] == [keys[2], keys[1]]  # part 0's keys alone, first
    assert sorted(asked[1]) == sorted([keys[0], keys[3], keys[4], keys[5]])
    assert len(asked) == 2
    assert seen == [(0, [3002, 3001]), (1, [3001, 3000]), (2, [3003, 3004])]
    assert res[:5] == [3000, 3001, 3002, 3003, 3004]
    assert res[5] == int(ErrorCode.INTERNAL_ERROR)  # located, not read
    for i in range(5):
        assert bytes(bufs[i][: 3000 + i]) == vals[i]
    assert not bufs[5].any()


def test_failed_second_lookup_fails_only_later_parts(daemons: Any,
                                                     make_client: Callable[..., Client],
                                                     key: Callable[[str], str]) -> None:
    c = make_client()
    keys, vals = _stored(c, key, 4)
    real_locate = c._parts.session.locate
    calls: list[int] = []

    def second_fails(ks: list[str]) -> Any:
        calls.append(len(ks))
        if len(calls) == 2:  # fault injection: the master unreachable for the second RPC
            raise MasterUnreachable("injected: master unreachable", ErrorCode.RPC_FAIL)
        return real_locate(ks)

    c._parts.session.locate = second_fails  # type: ignore[method-assign]
    bufs = [np.zeros(4000, np.uint8) for _ in keys]
    seen: list[tuple[int, list[int]]] = []
    res = c.batch_get_into_parts(keys, bufs, [[0, 1], [2, 3]],
                                 lambda p, r: seen.append((p, r)))
    assert seen[0] == (0, [3000, 3001])
    assert seen[1][0] == 1 and all(r < 0 for r in seen[1][1])
    assert res[:2] == [3000, 3001] and res[2] < 0 and res[3] < 0
    assert bytes(bufs[0][:3000]) == vals[0] and bytes(bufs[1][:3001]) == vals[1]
    assert not bufs[2].any() and not bufs[3].any()


def test_one_part_and_bad_keys(daemons: Any, make_client: Callable[..., Client],
                               key: Callable[[str], str]) -> None:
    c = make_client()
    keys, _vals = _stored(c, key, 2)
    bufs = [np.zeros(4000, np.uint8) for _ in range(4)]
    all_keys = [keys[0], "", keys[1], key("absent")]
    res = c.batch_get_into_parts(all_keys, bufs, [[0, 1, 3]], lambda p, r: None)
    assert res[0] == 3000 and res[1] == int(ErrorCode.INVALID_KEY)
    assert res[2] == int(ErrorCode.INTERNAL_ERROR)  # in no part: located, not read
    assert res[3] == int(ErrorCode.OBJECT_NOT_FOUND)
    assert not bufs[2].any()
    with pytest.raises(StoreError) as info:
        c.batch_get_into_parts(all_keys, bufs[:2], [[0]], lambda p, r: None)
    assert info.value.code == ErrorCode.INVALID_PARAMS


def test_second_lookups_reuse_their_threads_and_stop_at_close(
        daemons: Any, make_client: Callable[..., Client], key: Callable[[str], str]) -> None:
    """The second RPC of every pipelined read runs on the same kept threads
    (not a new thread per read); once the client is closed they are shut
    down and a late read is refused with CLOSED."""
    import threading

    c = make_client()
    keys, vals = _stored(c, key, 4)
    before = {t.name for t in threading.enumerate()}
    for _ in range(6):
        bufs = [np.zeros(4000, np.uint8) for _ in keys]
        got = c.batch_get_into_parts(keys, bufs, [[0], [1, 2, 3]], lambda p, r: None)
        assert got == [len(v) for v in vals]
        assert all(b[:len(v)].tobytes() == v for b, v in zip(bufs, vals, strict=True))
    locators = {t.name for t in threading.enumerate()} - before
    assert locators and all(n.startswith("kvpool-locate") for n in locators)
    assert len(locators) <= 2
    pool = c._parts.session._locate_pool
    c.close()
    assert pool is not None and pool._shutdown
    with pytest.raises(StoreError) as ei:
        c._parts.session.locate_later([keys[0]])
    assert ei.value.code == ErrorCode.CLOSED


def _counting_locates(c: Client) -> list[list[str]]:
    """Record the keys of every locate RPC ``c`` sends."""
    asked: list[list[str]] = []
    real = c._parts.session.locate

    def counting(ks: list[str]) -> Any:
        asked.append(list(ks))
        return real(ks)

    c._parts.session.locate = counting  # type: ignore[method-assign]
    return asked


def test_located_elsewhere_replaces_part_zeros_rpc(daemons: Any,
                                                   make_client: Callable[..., Client],
                                                   key: Callable[[str], str]) -> None:
    """A reply located by one client (vLLM's scheduler), pickled as vLLM ships
    metadata to its workers, lets another client read part 0 without asking
    the master: only the later parts' keys are located. Every byte lands."""
    import pickle

    scheduler, worker = make_client(), make_client()
    keys, vals = _stored(scheduler, key, 6)
    located = pickle.loads(pickle.dumps(scheduler.locate_for_reads(keys).subset(keys[:2])))
    assert located.keys == keys[:2] and located.usable(0.3)
    asked = _counting_locates(worker)
    bufs = [np.zeros(4000, np.uint8) for _ in keys]
    seen: list[tuple[int, list[int]]] = []
    res = worker.batch_get_into_parts(keys, bufs, [[1, 0], [2, 3], [4, 5]],
                                      lambda p, r: seen.append((p, r)), located=located)
    assert asked == [keys[2:]]  # one RPC, for the later parts only
    assert seen[0] == (0, [3001, 3000])
    assert res == [len(v) for v in vals]
    assert all(b[:len(v)].tobytes() == v for b, v in zip(bufs, vals, strict=True))


def test_located_ignored_when_short_stale_or_foreign(daemons: Any,
                                                     make_client: Callable[..., Client],
                                                     key: Callable[[str], str]) -> None:
    """A located reply that misses a key of part 0, has too little lease left,
    or comes from another boot (another host's monotonic clock) is not used:
    part 0 is located by its own RPC, as without one."""
    from dataclasses import replace

    c = make_client()
    keys, vals = _stored(c, key, 4)
    whole = c.locate_for_reads(keys)
    cases = {"misses a key": whole.subset(keys[:1]),
             "lease nearly over": replace(whole, deadline=time.monotonic() + 0.1),
             "another boot": replace(whole, boot="not-this-boot")}
    for why, located in cases.items():
        asked = _counting_locates(c)
        bufs = [np.zeros(4000, np.uint8) for _ in keys]
        res = c.batch_get_into_parts(keys, bufs, [[0, 1], [2, 3]], lambda p, r: None,
                                     located=located)
        assert asked[0] == keys[:2], why
        assert res == [len(v) for v in vals], why
        assert all(b[:len(v)].tobytes() == v for b, v in zip(bufs, vals, strict=True)), why
        del c._parts.session.locate  # back to the class's method


def test_merged_located_rebases_capabilities(daemons: Any,
                                             make_client: Callable[..., Client],
                                             key: Callable[[str], str]) -> None:
    """Replies of two lookups (two requests of one step) merged into one: each
    replica keeps the capability token its own reply granted (indices re-based
    onto the joined list), so the holders accept every read of part 0."""
    from kvpool.store.located import Located

    c = make_client()
    keys, vals = _stored(c, key, 8)  # spread over both node daemons
    a, b = c.locate_for_reads(keys[:4]), c.locate_for_reads(keys[4:])
    assert a.reply.caps and b.reply.caps  # capabilities are on: tokens to re-base
    merged = Located.merge([a, b])
    assert merged is not None and merged.keys == keys
    assert len(merged.reply.caps) == len(a.reply.caps) + len(b.reply.caps)
    assert Located.merge([a, replace_boot(b)]) is None
    asked = _counting_locates(c)
    bufs = [np.zeros(4000, np.uint8) for _ in keys]
    res = c.batch_get_into_parts(keys, bufs, [list(range(8))], lambda p, r: None,
                                 located=merged)
    assert asked == []  # nothing left to locate
    assert res == [len(v) for v in vals]
    assert all(x[:len(v)].tobytes() == v for x, v in zip(bufs, vals, strict=True))


def replace_boot(located: Any) -> Any:
    from dataclasses import replace

    return replace(located, boot="another-host")
