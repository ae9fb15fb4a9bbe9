"""How fast the machine under a benchmark is, measured beside it.

This box is a VM on a shared host: the same code measures up to ~2x slower
from one hour (or minute) to the next, as neighbours take CPU time (steal)
or slow the CPU down. The benchmarks record these so that their numbers
compare across runs: ``python_loop_us`` (a fixed pure-Python loop) and
``steal_pct`` (the CPU time the hypervisor gave to others).
"""

from __future__ import annotations

import os
import time

__all__ = ["host_cpu", "process_cpu_s", "python_loop_us", "steal_pct"]


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process's live threads have run so far, to the nanosecond
    (the first field of each ``/proc/PID/task/TID/schedstat``; /proc/PID/stat
    counts in 10 ms ticks, which over a ~1000-key measurement is +-10 µs a
    key). Falls back to /proc/PID/stat (ticks, every thread that ever ran)
    where schedstat is missing; 0.0 if the process is gone. Processes in
    other network namespaces share this one's /proc."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # the thread ended meanwhile
        if total:
            return total / 1e9
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_cpu() -> list[int]:
    """The machine's CPU time so far (/proc/stat "cpu" line, in ticks: user, nice,
    system, idle, iowait, irq, softirq, steal); [] where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def steal_pct(before: list[int], after: list[int]) -> float:
    """The share of this VM's CPU time (percent of all its vCPUs' time) that its
    hypervisor gave to others between two :func:`host_cpu` readings; 0.0 where
    unknown."""
    if len(before) < 8 or len(after) < 8:
        return 0.0
    total = sum(after) - sum(before)
    return round(100.0 * (after[7] - before[7]) / total, 1) if total > 0 else 0.0


def python_loop_us() -> float:
    """Microseconds of ``sum(range(1000))`` now (the best of 5 rounds of 2000):
    per-key costs of a Python service scale with it."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(2000):
            sum(range(1000))
        best = min(best, (time.perf_counter() - t) / 2000)
    return round(best * 1e6, 2)
