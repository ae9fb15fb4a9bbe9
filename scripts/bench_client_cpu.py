#!/usr/bin/env python
"""Client CPU per call of the 4 KiB hot paths, without the master's or a
holder's share: CPU-time measures that a loaded host disturbs far less than
wall-clock rates.

- ``store``: a real master and holder answer once; then the master stub replays
  the recorded replies, and the thread CPU time of ``batch_put_from`` /
  ``batch_get_into`` / ``get_batch`` (32 x 4 KiB, registered buffers) and
  ``put_from`` / ``get_into`` / ``put`` / ``get`` (one) is measured: the store
  client's own Python per call, shm copies inline, no RPC. (Single puts are
  recorded a few times, so that a put through a spare allocation, whose
  commit differs from a first put's, is recorded too.)
- ``engine``: ``TransferEngine.transfer`` / ``run`` of 32 (and 1) WRITE requests of
  4 KiB to a local segment through a transport that reports every request at
  once: the engine's own cost per batch.

Best of ``--reps`` repetitions each (the least disturbed). The JSON is a list
of records ``{transport: "client" | "engine", op, size, batch,
cpu_us_per_call}`` that ``scripts/bench_ab.py`` compares between two trees::

    .venv/bin/python scripts/bench_client_cpu.py --json out/client_cpu.json
"""

from __future__ import annotations

import argparse
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


def _record(transport: str, op: str, batch: int, cpu_us: float) -> dict[str, Any]:
    return {"transport": transport, "op": op, "size": 4096, "batch": batch,
            "cpu_us_per_call": cpu_us}


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
                recorded.setdefault(type(req).__name__, reply)
                return reply

            def replay(self: MasterClient, req: Any, timeout_s: float | None = None) -> Any:
                name = type(req).__name__
                return recorded[name] if name in recorded else real(self, req, timeout_s)

            keys = [f"k/{j}" for j in range(32)]
            value = bytes(arrs[0])
            MasterClient.call = record  # type: ignore[method-assign]
            try:
                c.batch_put_from(keys, hs)
                c.batch_get_into(keys, hs)
                for i in range(4):  # the later ones through spares, where the tree has them
                    c.put_from(f"one/{i}", hs[0])
                    c.put(f"two/{i}", value)
                c.get_into("one/0", hs[0])
                c.get("two/0")
                MasterClient.call = replay  # type: ignore[method-assign]
                cases: list[tuple[str, int, Callable[[], Any], int]] = [
                    ("batch_put_from", 32, lambda: c.batch_put_from(keys, hs), 2000),
                    ("batch_get_into", 32, lambda: c.batch_get_into(keys, hs), 2000),
                    ("get_batch", 32, lambda: c.get_batch(keys), 2000),
                    ("put_from", 1, lambda: c.put_from("one/0", hs[0]), 20000),
                    ("get_into", 1, lambda: c.get_into("one/0", hs[0]), 20000),
                    ("put", 1, lambda: c.put("two/0", value), 20000),
                    ("get", 1, lambda: c.get("two/0"), 20000),
                ]
                return [_record("client", op, batch, _best(fn, n, reps))
                        for op, batch, fn, n in cases]
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
            _record("engine", "transfer", 32, _best(lambda: e.transfer(reqs, 5.0), 2000, reps)),
            _record("engine", "run", 32, _best(lambda: e.run(reqs, 5.0), 2000, reps)),
            _record("engine", "transfer", 1,
                    _best(lambda: e.transfer(reqs[:1], 5.0), 20000, reps)),
            _record("engine", "run", 1, _best(lambda: e.run(reqs[:1], 5.0), 20000, reps)),
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
        log.warning("%s %s x%d: %.2f us", r["transport"], r["op"], r["batch"],
                    r["cpu_us_per_call"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
