#!/usr/bin/env python3
"""GPU checks of the transfer engine (run by the lead via scripts/gpu_check.py).

``run(report)`` exercises shm and tcp with torch and cupy GPU buffers (whichever
is installed) between this process and a peer process that owns the segment:
correctness (crc32 of the segment vs the GPU data, and a READ back compared on
the GPU) and GB/s per (library, transport, op). In the same run it measures
pinned cudaMemcpy H2D/D2H bandwidth as the limit; target: GPU<->shm >= 0.8x pinned.
``backends``: every CUDA runtime backend's copies (legacy and side stream,
2-D) checked byte for byte.

Standalone: ``python scripts/gpu_check_transfer.py [--json OUT]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.core.protocol import SegmentDescriptor
from kvpool.transfer import TransferEngine, TransferOp, TransferRequest, load_transfer_config
from kvpool.transfer.gpu import PinnedPool, cuda_runtime

#: the peer process (test scaffolding: tests/support/peer.py, run as a script)
PEER_SCRIPT = str(Path(__file__).resolve().parent.parent / "tests" / "support" / "peer.py")
CHUNK = 16 << 20
BATCH = 16  # 256 MiB per batch
ITERS = 5


def _gpu_libs() -> dict[str, Any]:
    libs: dict[str, Any] = {}
    try:
        import torch

        if torch.cuda.is_available():
            libs["torch"] = torch
    except Exception as exc:
        print(f"torch unavailable: {exc}")
    try:
        import cupy

        if cupy.cuda.is_available():
            libs["cupy"] = cupy
    except Exception as exc:
        print(f"cupy unavailable: {exc}")
    return libs


def _alloc(lib_name: str, lib: Any, n: int, seed: int) -> tuple[Any, Any]:
    """(gpu uint8 buffer of n random bytes, function returning a host numpy copy)."""
    if lib_name == "torch":
        g = lib.Generator(device="cuda")
        g.manual_seed(seed)
        t = lib.randint(0, 256, (n,), dtype=lib.uint8, device="cuda", generator=g)
        return t, lambda x=t: x.cpu().numpy()
    rs = lib.random.RandomState(seed)
    a = rs.randint(0, 256, n, dtype=lib.int32).astype(lib.uint8)
    return a, lambda x=a: lib.asnumpy(x)


def _zeros(lib_name: str, lib: Any, n: int) -> Any:
    if lib_name == "torch":
        return lib.zeros(n, dtype=lib.uint8, device="cuda")
    return lib.zeros(n, dtype=lib.uint8)


def _equal(lib_name: str, lib: Any, a: Any, b: Any) -> bool:
    if lib_name == "torch":
        return bool(lib.equal(a, b))
    return bool((a == b).all())


def _pinned_limit(rt: Any, dev_ptr: int) -> dict[str, float]:
    pool = PinnedPool(rt, 1, CHUNK * BATCH)
    try:
        host = pool.ptr(0)
        out = {}
        for name, (dst, src) in {"h2d": (dev_ptr, host), "d2h": (host, dev_ptr)}.items():
            rt.memcpy(dst, src, CHUNK)
            t0 = time.perf_counter()
            for _ in range(ITERS):
                for i in range(BATCH):
                    rt.memcpy(dst + i * CHUNK, src + i * CHUNK, CHUNK)
            out[name] = CHUNK * BATCH * ITERS / (time.perf_counter() - t0) / 1e9
        return out
    finally:
        pool.close()


def runtime_backends(report: dict[str, Any]) -> None:
    """Every CUDA runtime backend here (cupy, ctypes libcudart): device memory,
    a synchronous copy on the legacy stream and on a side stream, a 2-D
    copy, and the bytes back on the host. ``report["backends"]``: per backend
    "ok" or the error."""
    import ctypes

    from kvpool.transfer import gpu as gpu_mod

    rts: list[Any] = []
    rt, _ = cuda_runtime()
    if rt is not None:
        rts.append(rt)
    if rt is None or rt.backend != "cudart":
        for path in gpu_mod._cudart_candidates():
            try:
                rts.append(gpu_mod.CudaRuntime("cudart", ctypes.CDLL(path)))
                break
            except OSError:
                continue
    out: dict[str, str] = {}
    n, rows = 1 << 20, 8
    host = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    for r in rts:
        try:
            a, b = r.malloc(n, 0), r.malloc(n, 0)
            try:
                r.copy(a, int(host.ctypes.data), n, 0, False)  # H2D, legacy stream
                r.copy(b, a, n, 0, True)  # D2D on this thread's side stream
                back = np.zeros(n, np.uint8)
                r.copy(int(back.ctypes.data), b, n, 0, True)
                ok = bool((back == host).all())
                # rows of 4 KiB, 64 KiB apart -> packed
                w = 4096
                r.memcpy2d_async(b, w, a, n // rows, w, rows, r.side_stream(0))
                r.stream_synchronize(r.side_stream(0))
                r.memcpy_async(int(back.ctypes.data), b, w * rows, 0)
                r.stream_synchronize(0)
                want = np.concatenate([host[i * (n // rows):i * (n // rows) + w]
                                       for i in range(rows)])
                ok = ok and bool((back[:w * rows] == want).all())
            finally:
                r.free(a)
                r.free(b)
            out[r.backend] = "ok" if ok else "wrong bytes"
        except Exception as exc:
            out[r.backend] = f"{type(exc).__name__}: {exc}"
    report["backends"] = out
    print(f"CUDA runtime backends: {out}")
    if any(v != "ok" for v in out.values()):
        report["status"] = "failed"


def run(report: dict[str, Any]) -> None:
    """Record results into ``report`` (pinned_gbps, results[], ok, status);
    prints a summary. ``status`` is "failed" if any transfer was incorrect."""
    res = report
    rt, reason = cuda_runtime()
    if rt is None:
        res["skipped"] = reason
        res["status"] = "skipped"
        print(f"transfer GPU check skipped: {reason}")
        return
    res["cuda_backend"] = rt.backend
    runtime_backends(res)
    libs = _gpu_libs()
    if not libs:
        res["skipped"] = "neither torch nor cupy with CUDA is importable"
        res["status"] = "skipped"
        print(res["skipped"])
        return
    total = CHUNK * BATCH
    host_id = "gpu-check-host"
    peer = subprocess.Popen(
        [sys.executable, PEER_SCRIPT, "--segment-id", "gpu-check",
         "--size", str(total), "--host-id", host_id],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert peer.stdin is not None and peer.stdout is not None

    def peer_crc(off: int, n: int) -> int:
        assert peer.stdin is not None and peer.stdout is not None
        peer.stdin.write(f"crc {off} {n}\n")
        peer.stdin.flush()
        return int(peer.stdout.readline().split()[1])

    desc = SegmentDescriptor.from_wire(json.loads(peer.stdout.readline()))
    engine = TransferEngine(load_transfer_config(overrides={
        "transports": {"tcp": {"timeout_s": 120}, "shm": {"timeout_s": 120}}}), host_id)
    rows: list[dict[str, Any]] = []
    try:
        engine.add_peer_segment(desc)
        first = True
        for lib_name, lib in libs.items():
            src, to_host = _alloc(lib_name, lib, total, seed=7)
            dst = _zeros(lib_name, lib, total)
            if first:
                res["pinned_gbps"] = _pinned_limit(rt, engine.register_buffer(src).ptr)
                first = False
            expect_crc = zlib.crc32(to_host())
            hs, hd = engine.register_buffer(src), engine.register_buffer(dst)
            for transport in ("shm", "tcp"):
                for op, h in ((TransferOp.WRITE, hs), (TransferOp.READ, hd)):
                    reqs = [TransferRequest(op, h, desc.segment_id, i * CHUNK, CHUNK,
                                            buffer_offset=i * CHUNK, transport=transport)
                            for i in range(BATCH)]
                    st = engine.transfer(reqs, timeout=120)  # warm-up (registration, staging)
                    ok = all(s.ok for s in st)
                    t0 = time.perf_counter()
                    for _ in range(ITERS):
                        st = engine.transfer(reqs, timeout=120)
                        ok = ok and all(s.ok for s in st)
                    gbps = total * ITERS / (time.perf_counter() - t0) / 1e9
                    if op is TransferOp.WRITE:
                        correct = ok and peer_crc(0, total) == expect_crc
                    else:
                        correct = ok and _equal(lib_name, lib, src, dst)
                        dst.fill_(0) if lib_name == "torch" else dst.fill(0)
                    errors = [e for s in st for e in s.errors][:3]
                    rows.append({"lib": lib_name, "transport": transport, "op": op.name,
                                 "gbps": round(gbps, 2), "correct": bool(correct),
                                 "errors": errors})
            # raw device pointer (no library object) through shm
            h_raw = engine.register_buffer((hs.ptr, total), device="cuda")
            st = engine.transfer([TransferRequest(TransferOp.WRITE, h_raw, desc.segment_id, 0,
                                                  CHUNK)], timeout=60)
            rows.append({"lib": f"{lib_name}-rawptr", "transport": st[0].transport, "op": "WRITE",
                         "gbps": None,
                         "correct": st[0].ok and peer_crc(0, CHUNK) == zlib.crc32(
                             to_host()[:CHUNK])})
    finally:
        engine.close()
        peer.stdin.write("exit\n")
        peer.stdin.flush()
        peer.wait(30)
    res["results"] = rows
    pinned = res.get("pinned_gbps", {})
    for r in rows:
        limit = pinned.get("h2d" if r["op"] == "READ" else "d2h")
        if r["gbps"] is not None and limit:
            r["ratio_vs_pinned"] = round(r["gbps"] / limit, 2)
    print(f"pinned cudaMemcpy GB/s: {pinned}")
    print(f"{'lib':<14} {'transport':<9} {'op':<5} {'GB/s':>7} {'x pinned':>8} correct")
    for r in rows:
        gb = "" if r["gbps"] is None else f"{r['gbps']:.2f}"
        print(f"{r['lib']:<14} {r['transport'] or '-':<9} {r['op']:<5} {gb:>7} "
              f"{r.get('ratio_vs_pinned', ''):>8} {r['correct']}")
    res["ok"] = all(r["correct"] for r in rows) and all(
        v == "ok" for v in res.get("backends", {}).values())
    if not res["ok"]:
        res["status"] = "failed"


if __name__ == "__main__":
    rep: dict[str, Any] = {}
    run(rep)
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(rep, f, indent=1, default=str)
    np.seterr()
