"""kvpool.core.spin: a poll stops when a yield comes back late (another task
held the CPU), and two late yields close together pause every poll of the
process; a shut gate still probes; a wait slept through counts as the window."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from kvpool.core import spin

pytestmark = pytest.mark.timeout(60)


def _burn(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_busy_cpu_pauses_the_polls() -> None:
    """A CPU-bound process on this thread's CPU: yields come back late, the
    polls pause; then, after the pause, they run again."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    ctx = mp.get_context("fork")
    hog = ctx.Process(target=_burn, args=(time.monotonic() + 20.0,), daemon=True)
    os.sched_setaffinity(0, {cpu})
    try:
        hog.start()  # inherits the one CPU
        spin._paused_until = 0.0
        assert spin.polling()
        end = time.monotonic() + 15.0
        late = 0
        while spin.polling() and time.monotonic() < end:
            if not spin.yield_cpu():
                late += 1
        assert late >= 2 and not spin.polling()  # paused by late yields close together
    finally:
        hog.kill()
        hog.join(5)
        os.sched_setaffinity(0, before)
    # alone again: the pause ends, and yields are quick
    spin._paused_until = time.perf_counter() + 0.05
    time.sleep(0.06)
    assert spin.polling()


def test_a_shut_gate_probes_every_eighth_wait() -> None:
    skipped = [0, 0]
    got = [spin.probe(skipped, 1) for _ in range(3 * spin._PROBE_EVERY)]
    assert got.count(True) == 3 and got[spin._PROBE_EVERY - 1] and not got[0]
    assert skipped[0] == 0


def test_a_wait_slept_through_counts_as_the_window() -> None:
    w = 150e-6
    assert spin.wait_sample(40e-6, True, w) == 40e-6
    assert spin.wait_sample(40e-6, False, w) == 40e-6  # fast even without a poll
    assert spin.wait_sample(1.0, True, w) == 2 * w
    assert spin.wait_sample(1.0, False, w) == w


def test_recv_polling_returns_what_came_or_gives_up_at_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    # no yield counts as late here: on a busy CI box one would end the poll
    # early (that case is test_late_yields_*); this test is about the deadline
    monkeypatch.setattr(spin, "_BUSY_S", 3600.0)
    a, b = socket.socketpair()
    try:
        buf = bytearray(16)
        t = time.perf_counter()
        assert spin.recv_polling(a, buf, t + 0.002) == -1  # nothing came: sleep instead
        assert time.perf_counter() - t >= 0.002
        b.sendall(b"reply")
        assert spin.recv_polling(a, buf, time.perf_counter() + 1.0) == 5
        assert bytes(buf[:5]) == b"reply"
        b.close()
        assert spin.recv_polling(a, buf, time.perf_counter() + 1.0) == 0  # the peer closed
    finally:
        a.close()
        b.close()
