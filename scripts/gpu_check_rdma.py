#!/usr/bin/env python3
"""GPU checks of the ``rdma`` transport (run by the lead via scripts/gpu_check.py
``--only rdma``, or standalone: ``python scripts/gpu_check_rdma.py [--json OUT]``).

The H200 machines have no RDMA device, so this cannot test RDMA itself. It
records what pyverbs says there, then runs the transport's GPU staging path
for real on the GPU: torch CUDA tensors (registered with the engine, but not
registrable by the NIC, as without nvidia-peermem) WRITTEN to and READ back
from a remote memory segment, with cudaMemcpy through the transport's
registered host staging buffers and the verbs layer replaced by
LoopbackVerbsDouble (tests/support/verbs_double.py; a fake of the RDMA
hardware whose "wire" is a memmove). Correctness is checked byte for byte;
the GB/s are those of staging + memmove, NOT of RDMA.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20


def _double() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import verbs_double

    return verbs_double


def run(report: dict[str, Any]) -> None:
    from kvpool.transfer import (
        MemorySegment,
        TransferEngine,
        TransferOp,
        TransferRequest,
        load_transfer_config,
    )
    from kvpool.transfer.config import TransportSettings
    from kvpool.transfer.rdma_verbs import PyverbsVerbs
    from kvpool.transfer.transports.rdma import RdmaTransport

    ok, reason = PyverbsVerbs().available()
    report["pyverbs_available"] = ok
    report["pyverbs_reason"] = reason
    try:
        import torch
    except ImportError as exc:
        report["status"] = "skipped"
        report["reason"] = f"torch not importable: {exc}"
        return
    if not torch.cuda.is_available():
        report["status"] = "skipped"
        report["reason"] = "no CUDA device"
        return
    dbl = _double()
    fabric = dbl.LoopbackFabric()
    settings = TransportSettings(timeout_s=60.0, staging_buffers=8, staging_size=4 * MiB,
                                 options={"qp_depth": 64, "max_wr_bytes": "4MiB"})
    settings.validate()
    n = 256 * MiB
    a = TransferEngine(load_transfer_config(), "gpu-host-a", client_id="a")
    b = TransferEngine(load_transfer_config(), "gpu-host-b", client_id="b")
    seg = MemorySegment.create(f"rdma-gpu-{uuid.uuid4().hex[:8]}", n)
    try:
        ra = RdmaTransport(settings, verbs=dbl.LoopbackVerbsDouble(fabric))
        rb = RdmaTransport(settings, verbs=dbl.LoopbackVerbsDouble(fabric))
        a.register_transport(ra, settings)
        b.register_transport(rb, settings)
        desc = b.add_local_segment(seg)
        desc.extra.update(rb.describe_segment(seg))
        a.add_peer_segment(desc)
        g = torch.Generator(device="cuda")
        g.manual_seed(11)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
        # the NIC cannot register device memory here (no peer-memory client)
        fabric.unregistrable += [(src.data_ptr(), n), (dst.data_ptr(), n)]
        hs, hd = a.register_buffer(src), a.register_buffer(dst)
        results: dict[str, Any] = {}
        for name, op, h in (("write", TransferOp.WRITE, hs), ("read", TransferOp.READ, hd)):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                [st] = a.transfer([TransferRequest(op, h, seg.segment_id, 0, n)], timeout=120)
                best = min(best, time.perf_counter() - t0)
                if not (st.ok and st.transport == "rdma"):
                    raise AssertionError(f"{name}: {st}")
            results[f"staged_{name}_GBps"] = round(n / best / 1e9, 2)
        host = seg.array()
        if not np.array_equal(host, src.cpu().numpy()):
            raise AssertionError("segment differs from the GPU source after rdma WRITE")
        if not bool(torch.equal(src, dst)):
            raise AssertionError("GPU destination differs after rdma READ")
        stats = ra.stats()
        results["staged_bytes"] = stats["staged_bytes"]
        results["wrs_posted"] = stats["wrs_posted"]
        results["note"] = ("GPU <-> registered host staging (cudaMemcpy) + loopback double "
                           "(memmove); not an RDMA bandwidth")
        report.update(results)
        report["status"] = "ok"
        for k, v in results.items():
            print(f"rdma {k}: {v}")
    finally:
        a.close()
        b.close()
        seg.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rep: dict[str, Any] = {}
    run(rep)
    print(json.dumps(rep, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
