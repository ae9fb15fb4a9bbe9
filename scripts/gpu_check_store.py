#!/usr/bin/env python3
"""GPU checks of the store client (run by the lead via scripts/gpu_check.py).

``run(report)`` starts a real master and a holder node daemon (host memory),
then, from this process as a pure client, stores torch CUDA tensors with
``put_from`` / ``batch_put_from`` and reads them back into other CUDA tensors
with ``get_into`` / ``batch_get_into`` (registered buffers), over shm (same
host) and over tcp (forced by a selector override: host staging). It checks
the bytes on the GPU (torch.equal) and records GB/s per (transport, op). The
Mooncake-compatible class is checked with raw ``data_ptr()`` GPU addresses
(put_from / get_into / batch_get_into, register_buffer).

First calls and steady state are reported apart: ``<t>_first_put_from_ms`` /
``<t>_first_get_into_ms`` time the first put and get of a fresh client (which
may still wait for one-time preparation: page-locking the holder's mapping,
the staging pool), ``<t>_put_from_gbps`` etc. are ITERS calls after it, and
``<t>_single_vs_batch_put_from`` is single put_from GB/s over batch_put_from
GB/s (target >= 0.7 on shm): the median over ROUNDS rounds, each timing BATCH
single puts and then one batch put of the same buffers (so the host's drift
between the two cancels out). ``<t>_put_from_breakdown_us``: a single put's
median time in master calls, in the copy, and in total.

Standalone: ``python scripts/gpu_check_store.py [--json OUT]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

SIZE = 16 << 20
BATCH = 8
ITERS = 16
ROUNDS = 7  # rounds of BATCH single puts + one batch put (median)
FORCE_TCP = {"rules": [{"name": "gpu-check-force-tcp", "transports": ["tcp"]}]}


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _put_breakdown(c: Any, transport: str, hs: list[Any]) -> dict[str, float]:
    """Median microseconds per single put_from spent in master calls and in the
    copy (the client's own methods wrapped with timers), and in total."""
    phases: dict[str, list[float]] = {"master": [], "copy": [], "total": []}
    session, writes = c._parts.session, c._parts.writes
    orig_call, orig_copy = session.call, writes._write

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name].append(time.perf_counter() - t0)
        return run

    session.call, writes._write = timed("master", orig_call), timed("copy", orig_copy)
    try:
        for i in range(ITERS):
            t = time.perf_counter()
            c.put_from(f"{transport}/timed/{i}", hs[i % BATCH])
            phases["total"].append(time.perf_counter() - t)
    finally:
        del session.call, writes._write
    calls = len(phases["master"]) / ITERS
    out = {k: round(1e6 * statistics.median(v), 1) for k, v in phases.items() if v}
    out["master_calls_per_put"] = calls
    out["master"] = round(out.get("master", 0.0) * calls, 1)
    return out


def _client_checks(torch: Any, master: str, transport: str, out: dict[str, Any]) -> None:
    from kvpool.store import Client, ClientConfig

    over = FORCE_TCP if transport == "tcp" else {}
    with Client(ClientConfig(master_address=master, transfer_overrides=over)) as c:
        dev = torch.device("cuda:0")
        srcs = [torch.randint(0, 255, (SIZE,), dtype=torch.uint8, device=dev) for _ in range(BATCH)]
        dsts = [torch.zeros(SIZE, dtype=torch.uint8, device=dev) for _ in range(BATCH)]
        hs = [c.register_buffer(t) for t in srcs]
        hd = [c.register_buffer(t) for t in dsts]
        torch.cuda.synchronize()
        # first calls of this client
        t = time.perf_counter()
        c.put_from(f"{transport}/first", hs[0])
        out[f"{transport}_first_put_from_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        t = time.perf_counter()
        assert c.get_into(f"{transport}/first", hd[0]) == SIZE
        out[f"{transport}_first_get_into_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        torch.cuda.synchronize()
        assert torch.equal(srcs[0], dsts[0]), f"{transport} first get_into mismatch"
        # steady state: single put_from / get_into
        t = time.perf_counter()
        for i in range(ITERS):
            c.put_from(f"{transport}/single/{i}", hs[i % BATCH])
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(ITERS):
            assert c.get_into(f"{transport}/single/{i}", hd[i % BATCH]) == SIZE
        get_s = time.perf_counter() - t
        torch.cuda.synchronize()
        for i in range(min(ITERS, BATCH)):
            assert torch.equal(srcs[i], dsts[i]), f"{transport} get_into mismatch at {i}"
        out[f"{transport}_put_from_gbps"] = _gbps(ITERS * SIZE, put_s)
        out[f"{transport}_get_into_gbps"] = _gbps(ITERS * SIZE, get_s)
        out[f"{transport}_put_from_breakdown_us"] = _put_breakdown(c, transport, hs)
        c.remove_all(force=True)
        # batch forms (median of ROUNDS); each round also times BATCH single
        # put_from calls of the same buffers right before its batch, so single
        # and batch are compared round by round (drift of the host cancels out)
        bput, bget, ratios = [], [], []
        for r in range(ROUNDS):
            for d in dsts:
                d.zero_()
            t = time.perf_counter()
            for i in range(BATCH):
                c.put_from(f"{transport}/round/{r}/{i}", hs[i])
            single_s = time.perf_counter() - t
            keys = [f"{transport}/batch/{r}/{i}" for i in range(BATCH)]
            t = time.perf_counter()
            codes = c.batch_put_from(keys, hs)
            bput.append(time.perf_counter() - t)
            ratios.append(bput[-1] / single_s)
            assert all(int(x) == 0 for x in codes), codes
            t = time.perf_counter()
            res = c.batch_get_into(keys, hd)
            bget.append(time.perf_counter() - t)
            assert res == [SIZE] * BATCH, res
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(srcs, dsts, strict=True))
            # a host get of a GPU-written value sees the same bytes
            assert c.get(keys[0]) == srcs[0].cpu().numpy().tobytes()
            c.remove_all(force=True)
        out[f"{transport}_batch_put_from_gbps"] = _gbps(BATCH * SIZE, statistics.median(bput))
        out[f"{transport}_batch_get_into_gbps"] = _gbps(BATCH * SIZE, statistics.median(bget))
        # single put_from GB/s over batch_put_from GB/s: the median of the rounds
        out[f"{transport}_single_vs_batch_put_from"] = round(statistics.median(ratios), 3)
        out[f"{transport}_single_vs_batch_put_from_rounds"] = [round(x, 3) for x in ratios]
        for h in hs + hd:
            c.unregister_buffer(h)


def _mooncake_checks(torch: Any, master: str, out: dict[str, Any]) -> None:
    from kvpool.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 0, "tcp", "", master) == 0
    try:
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros(2 << 20, dtype=torch.uint8, device="cuda:0")
        assert s.register_buffer(dst.data_ptr(), dst.numel()) == 0
        assert s.put_from("mc/gpu", src.data_ptr(), src.numel()) == 0
        assert s.get_into("mc/gpu", dst.data_ptr(), dst.numel()) == src.numel()
        torch.cuda.synchronize()
        assert torch.equal(dst[: src.numel()], src)
        assert s.get_into("mc/gpu", dst.data_ptr(), 100) < 0  # too small
        assert s.batch_get_into(["mc/gpu"], [dst.data_ptr() + 4096], [1 << 20]) == [1 << 20]
        torch.cuda.synchronize()
        assert torch.equal(dst[4096:4096 + (1 << 20)], src)
        assert s.unregister_buffer(dst.data_ptr()) == 0
        out["mooncake_gpu_ptr"] = "ok"
    finally:
        s.close()


def run(report: dict[str, Any]) -> None:
    """Record the store's GPU results under ``report["store"]`` (raises on a failed check)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    out: dict[str, Any] = report.setdefault("store", {})
    # remove_all(force=True) holds the space of read-leased objects until their
    # leases end (master/removal.py): room for every object either transport's checks
    # read before a removal (the single calls', each round's batch) besides the working set
    pool = (2 * (ITERS + 1 + ROUNDS * BATCH) + 3 * BATCH + 8) * SIZE
    with MasterProcess() as m, NodeDaemonProcess(m.address, pool):
        for transport in ("shm", "tcp"):
            _client_checks(torch, m.address, transport, out)
        _mooncake_checks(torch, m.address, out)
    for k, v in out.items():
        print(f"store {k}: {v}")
    ratio = out.get("shm_single_vs_batch_put_from", 0.0)
    print(f"store target: shm single put_from / batch_put_from >= 0.7: {ratio} "
          f"{'OK' if ratio >= 0.7 else 'MISSED'}")


if __name__ == "__main__":
    rep: dict[str, Any] = {}
    run(rep)
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(rep, f, indent=1)
