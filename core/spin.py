"""Polling for a near reply without sleeping: when to poll, when to stop.

A thread that expects a reply within about a hundred µs may poll for it
instead of sleeping (the RPC stub, the bulk client, the master's loop after an
answer). On a VM whose idle vCPUs halt, waking a sleeping thread on a halted
vCPU costs tens of µs, several times a small round trip between polling ends
(docs/BENCHMARKS.md). A poll keeps its vCPU awake, so a peer woken onto it
runs at once; each try yields the CPU (``sched_yield``) so that such a peer
gets it.

Two things go wrong with a plain poll there:

- **A busy CPU.** With another runnable task on the CPU (a CPU-bound
  process), ``sched_yield`` hands it the CPU for its time slice (milliseconds,
  where a yield alone takes about a µs), and a reply that arrives
  meanwhile waits for it, where a sleeping thread would have been woken at
  once. :func:`yield_cpu` ends a poll whose yield came back late; a second
  late yield within ``_BURST_S`` of the first (a busy CPU, not a passing
  interrupt) pauses every poll of this process for ``_PAUSE_S``
  (:func:`polling` is False meanwhile). A busy CPU does not halt either,
  so polling buys nothing there.
- **A gate that locks itself shut.** A poll is worth it while replies come
  within its window, judged from a moving average of past waits; but a wait
  slept through includes the wake-up, which on a halting vCPU is what the
  poll saves, so once polls stop the waits look too long for them to start
  again. :func:`wait_sample` counts a wait slept through as at most the
  window (it says only that the reply was not there in time to tell), and
  :func:`probe` polls every ``_PROBE_EVERY``-th time the gate is shut, so the
  average learns what a poll would see.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

__all__ = ["polling", "probe", "recv_polling", "wait_sample", "yield_cpu"]

# a yield that took this long ran another task for a time slice (the scheduler's
# slices are ~0.75-4 ms; a peer serving a one-key request runs for ~20-80 µs)
_BUSY_S = 300e-6
_BURST_S = 0.02  # two late yields this close: the CPU is busy (pause)
_PAUSE_S = 0.5  # no polling for this long then
_PROBE_EVERY = 8  # a shut gate still polls once in this many waits
_clock = time.perf_counter
_DONTWAIT = socket.MSG_DONTWAIT
_sched_yield = os.sched_yield
_paused_until = 0.0
_last_late = -1.0


def polling() -> bool:
    """Whether polls may run now (not paused by late yields)."""
    return _clock() >= _paused_until


def yield_cpu() -> bool:
    """Yield the CPU once; False when that took long enough that another task
    must have run (stop polling and sleep; a second such yield soon after
    pauses the polls of the process)."""
    t = _clock()
    _sched_yield()
    now = _clock()
    if now - t < _BUSY_S:
        return True
    global _paused_until, _last_late
    if now - _last_late < _BURST_S:
        _paused_until = now + _PAUSE_S
    _last_late = now
    return False


def recv_polling(sock: socket.socket, buf: Any, until: float) -> int:
    """``sock.recv_into(buf)`` without sleeping until ``until`` (perf_counter
    time), yielding the CPU between tries (a peer may be waiting for it); -1
    when nothing came by then or a late yield ended the poll (the caller then
    sleeps in a blocking receive)."""
    while True:
        try:
            return sock.recv_into(buf, 0, _DONTWAIT)
        except BlockingIOError:
            if _clock() >= until or not yield_cpu():
                return -1


def probe(skipped: list[int], i: int) -> bool:
    """A gate that is shut: count the wait in ``skipped[i]``; True (poll this
    once) every ``_PROBE_EVERY``-th time."""
    n = skipped[i] + 1
    if n < _PROBE_EVERY:
        skipped[i] = n
        return False
    skipped[i] = 0
    return True


def wait_sample(wait: float, polled: bool, window: float) -> float:
    """What a wait of ``wait`` seconds tells a gate with this ``window``: at
    most twice the window when it polled (one stall does not shut the gate
    for long), at most the window when it slept (see the module doc)."""
    return min(wait, 2 * window if polled else window)
