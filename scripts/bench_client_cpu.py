#!/usr/bin/env python
"""Client CPU per call of the 4 KiB hot paths, without the master's or a
holder's share: CPU-time measures that a loaded host disturbs far less than
wall-clock rates.

- ``store``: a real master and holder answer once; then the master stub replays
  the recorded replies, and the thread CPU time of ``batch_put_from`` /
  ``batch_get_into`` / ``get_batch`` (32 x 4 KiB, registered buffers) and
  ``put_from`` / ``get_into`` / ``put`` / ``get`` (one) is measured: the store
  client's own Python per call, shm copies inline, no RPC. Each case's
  replies are recorded just before it runs; a put's are recorded three times
  with fresh keys and the last kept, so that a put through spare allocations,
  whose commit differs from a first put's, is measured as a stream of such
  puts makes it.
- ``engine``: ``TransferEngine.transfer`` / ``run`` of 32 (and 1) WRITE requests of
  4 KiB to a local segment through a transport that reports every request at
  once: the engine's own cost per batch.

Best of ``--reps`` repetitions each (the least disturbed). Each record also
carries ``opcodes_per_call`` and ``py_calls_per_call``: the Python bytecodes
executed and Python functions entered by one call, counted under a tracer.
They are exact and do not move with the machine's speed, so they compare two
trees on a VM whose CPU time moves 2x within an hour (a bytecode costs about
the same wherever it runs; C work, a copy or a decode, is not counted). The
JSON is a list of records ``{transport: "client" | "engine", op, size,
batch, cpu_us_per_call, opcodes_per_call, py_calls_per_call}`` that
``scripts/bench_ab.py`` compares between two trees::

    .venv/bin/python scripts/bench_client_cpu.py --json out/client_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("bench_client_cpu")


def _best(fn: Callable[[], Any], n: int, reps: int) -> float:
    """Least thread CPU time of ``n`` calls over ``reps`` repetitions, µs per call."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return round(best, 2)


def _work(fn: Callable[[], Any]) -> tuple[int, int]:
    """(bytecodes executed, Python functions entered) by one ``fn()`` on this
    thread (other threads are not traced)."""
    counts = [0, 0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            counts[1] += 1
        elif event == "opcode":
            counts[0] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts[0], counts[1] - 1  # (fn's own frame is not the code measured)


def _record(transport: str, op: str, batch: int, fn: Callable[[], Any], n: int,
            reps: int) -> dict[str, Any]:
    """The record of ``fn``: its CPU per call (:func:`_best`), then its work
    (:func:`_work`, one more call)."""
    cpu_us = _best(fn, n, reps)
    opcodes, calls = _work(fn)
    return {"transport": transport, "op": op, "size": 4096, "batch": batch,
            "cpu_us_per_call": cpu_us, "opcodes_per_call": opcodes,
            "py_calls_per_call": calls}


def store_cpu(reps: int) -> list[dict[str, Any]]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.core.rpc_client import MasterClient
    from kvpool.store import Client, ClientConfig

    with MasterProcess() as m, NodeDaemonProcess(m.address, "256MiB"):
        c = Client(ClientConfig(master_address=m.address)).setup()
        try:
            arrs = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8)
                    for i in range(32)]
            hs = [c.register_buffer(a) for a in arrs]
            for i in range(5):  # map the holder's segment, warm the caches
                c.batch_put_from([f"warm/{i}/{j}" for j in range(32)], hs)
            recorded: dict[str, Any] = {}
            real = MasterClient.call

            def record(self: MasterClient, req: Any, timeout_s: float | None = None) -> Any:
                reply = real(self, req, timeout_s)
                recorded[type(req).__name__] = reply  # the latest: the steady state's
                return reply

            unrecorded: set[str] = set()

            def replay(self: MasterClient, req: Any, timeout_s: float | None = None) -> Any:
                name = type(req).__name__
                if name in recorded:
                    return recorded[name]
                if name != "Ping":  # (the liveness thread's, not the measured one's)
                    unrecorded.add(name)  # a real round trip: the case is not comparable
                return real(self, req, timeout_s)

            value = bytes(arrs[0])

            # each prefix's 32 keys, made once (not inside the measured calls)
            prefixes = ("r0", "r1", "m")
            keys = {p: [f"{p}/k/{j}" for j in range(32)] for p in prefixes}
            one = {p: f"{p}/one" for p in prefixes}
            two = {p: f"{p}/two" for p in prefixes}

            # (op, batch, call on the keys of a prefix, calls, a put: recorded 3 times)
            cases: list[tuple[str, int, Callable[[str], Any], int, bool]] = [
                ("batch_put_from", 32, lambda p: c.batch_put_from(keys[p], hs), 2000, True),
                ("batch_get_into", 32, lambda p: c.batch_get_into(keys[p], hs), 2000, False),
                ("get_batch", 32, lambda p: c.get_batch(keys[p]), 2000, False),
                ("put_from", 1, lambda p: c.put_from(one[p], hs[0]), 20000, True),
                ("get_into", 1, lambda p: c.get_into(one[p], hs[0]), 20000, False),
                ("put", 1, lambda p: c.put(two[p], value), 20000, True),
                ("get", 1, lambda p: c.get(two[p]), 20000, False),
            ]
            out = []
            try:
                for op, batch, fn, n, put in cases:
                    # Each case's replies are recorded just before it is measured: a
                    # put's last recording (fresh keys, spares as a stream of such puts
                    # has them) is its steady state. Reads read what the puts put.
                    MasterClient.call = record  # type: ignore[method-assign]
                    for p in (prefixes if put else ["m"]):
                        fn(p)
                    MasterClient.call = replay  # type: ignore[method-assign]
                    out.append(_record("client", op, batch, functools.partial(fn, "m"), n,
                                       reps))
                    if unrecorded:
                        log.error("%s made real calls while measured: %s", op,
                                  sorted(unrecorded))
                        unrecorded.clear()
                return out
            finally:
                MasterClient.call = real  # type: ignore[method-assign]
        finally:
            c.close()


def engine_cpu(reps: int) -> list[dict[str, Any]]:
    from kvpool.transfer import TransferEngine
    from kvpool.transfer.config import load_transfer_config
    from kvpool.transfer.segment import MemorySegment
    from kvpool.transfer.transports import TRANSPORT_CLASSES
    from kvpool.transfer.transports.base import ReportFn, Transport, WorkItem
    from kvpool.transfer.types import TransferOp, TransferRequest

    class InstantTransport(Transport):
        """Reports every request done at once (moves nothing)."""

        name = "instant"

        def available(self) -> tuple[bool, str]:
            return True, ""

        def supports(self, kind: Any, same_host: bool, device: str) -> bool:
            return True

        def execute(self, items: Sequence[WorkItem], deadline: float,
                    report: ReportFn) -> None:
            for it in items:
                report(it, None)

    TRANSPORT_CLASSES.setdefault("instant", f"{__name__}:InstantTransport")
    cfg = load_transfer_config(overrides={"rules": [{"name": "all", "transports": ["instant"]}],
                                          "server": {"enabled": False}})
    e = TransferEngine(cfg, "bench-host")
    seg = MemorySegment.create(f"bench-{uuid.uuid4().hex[:8]}", 1 << 20)
    try:
        e.register_transport(InstantTransport())
        e.add_local_segment(seg)
        bufs = [e.register_buffer(np.zeros(4096, np.uint8)) for _ in range(32)]
        reqs = [TransferRequest(TransferOp.WRITE, bufs[i], seg.segment_id, i * 4096, 4096, 0,
                                None, b"c" * 500) for i in range(32)]
        return [
            _record("engine", "transfer", 32, lambda: e.transfer(reqs, 5.0), 2000, reps),
            _record("engine", "run", 32, lambda: e.run(reqs, 5.0), 2000, reps),
            _record("engine", "transfer", 1, lambda: e.transfer(reqs[:1], 5.0), 20000, reps),
            _record("engine", "run", 1, lambda: e.run(reqs[:1], 5.0), 20000, reps),
        ]
    finally:
        e.close()
        seg.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the record here")
    p.add_argument("--reps", type=int, default=9, help="repetitions (the best is kept)")
    args = p.parse_args()
    from kvpool.core.config import setup_logging

    setup_logging("WARNING")
    records = store_cpu(args.reps) + engine_cpu(args.reps)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    for r in records:
        log.warning("%s %s x%d: %.2f us, %d bytecodes, %d Python calls", r["transport"],
                    r["op"], r["batch"], r["cpu_us_per_call"], r["opcodes_per_call"],
                    r["py_calls_per_call"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
