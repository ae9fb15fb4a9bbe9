"""The master's held PINGs (kvpool.master.parked), as the serving loop drives
them: a handler asks, the loop holds, a task or the client's next PING
releases, a deadline ends the wait. (The loop and real nodes:
tests/tier/test_tier_long_poll.py.)"""

from __future__ import annotations

import time

from kvpool.core.protocol import PING_MAX_WAIT_S
from kvpool.master.parked import ParkedPings


def _held(p: ParkedPings, client_id: str, wait_ms: int, tag: bytes) -> None:
    p.allowed = True
    assert p.ask(client_id, wait_ms)
    p.hold([b"id-" + tag, tag], peer=None)
    p.allowed = False


def test_ask_only_while_the_loop_allows_and_for_a_positive_wait() -> None:
    p = ParkedPings()
    assert not p.ask("a", 1000)  # outside the ZeroMQ drain (e.g. the same-host socket)
    p.allowed = True
    assert not p.ask("a", 0) and not p.ask("a", -5)
    assert p.asked is None
    assert p.ask("a", 10**9)
    assert p.asked == ("a", PING_MAX_WAIT_S)  # capped


def test_release_deadline_and_one_held_ping_per_client() -> None:
    p = ParkedPings()
    now = time.monotonic()
    _held(p, "a", 60_000, b"a1")
    _held(p, "b", 1, b"b1")  # 1 ms
    assert len(p) == 2 and not p.ready(now - 1)
    # b's wait ends; a stays held
    later = time.monotonic() + 0.01
    assert p.ready(later)
    assert p.due(later) == [([b"id-b1", b"b1"], None)]
    assert len(p) == 1 and not p.ready(later)
    # a task for a (or its PING without a wait): answered at the next turn
    p.release("a")
    p.release("nobody")  # nothing held: nothing happens
    assert p.ready(later) and p.due(later) == [([b"id-a1", b"a1"], None)]
    assert len(p) == 0 and not p.ready(later + 100)  # a's deadline entry is gone too
    # a second held PING of the same client answers the first one
    _held(p, "c", 60_000, b"c1")
    _held(p, "c", 60_000, b"c2")
    assert len(p) == 1 and p.due(time.monotonic()) == [([b"id-c1", b"c1"], None)]
    p.release("c")
    assert p.due(time.monotonic()) == [([b"id-c2", b"c2"], None)]


def test_drop_forgets_everything() -> None:
    p = ParkedPings()
    _held(p, "a", 60_000, b"a")
    _held(p, "b", 60_000, b"b")
    p.release("a")
    assert p.drop() == 2
    assert len(p) == 0 and not p.ready(time.monotonic() + 100)
    assert p.due(time.monotonic() + 100) == []
