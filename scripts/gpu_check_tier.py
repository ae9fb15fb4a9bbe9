#!/usr/bin/env python3
"""GPU checks of the SSD tier (run by the lead via scripts/gpu_check.py).

``run(report)`` moves a GPU buffer (torch or cupy, whichever is installed) to
and from a :class:`FileSegment` through ``gds`` (kvikio CuFile) and ``posix``
(pinned host staging): correctness (crc32 of the file range vs the GPU data
after WRITE; READ back compared on the GPU) and GB/s per (transport, op),
reads cold (page cache dropped first). In the same run it measures the disk
limit: a plain O_DIRECT pwrite/pread of the same bytes from a host buffer.
Target: GPU<->file >= 0.9x the disk limit. It states whether GPUDirect Storage
is present: without the nvidia-fs driver kvikio runs in its POSIX
compatibility mode (bounce buffers), which is what the H200 machine has.

``store`` rows: the same bytes as 16 MiB disk-only objects through a real
master and node daemon with a disk tier, read cold with ``get_into`` straight
into GPU memory (the store reads this host's file replicas on the caller's
thread: ``gds`` or ``posix`` staging as the selector says), compared on the GPU,
GB/s against the same disk limit. Target: >= 0.8x.

Standalone: ``python scripts/gpu_check_tier.py [--json OUT]``; env
``KVPOOL_GPU_TIER_OPTIONS`` (JSON) sets transport options for a comparison run,
e.g. ``{"posix": {"pipeline_depth": 1}, "gds": {"threads": 1}}`` = serial bounce.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
import tempfile
import time
import zlib
from typing import Any

import numpy as np

from kvpool.transfer import TransferEngine, TransferOp, TransferRequest, load_transfer_config
from kvpool.transfer.file_segment import FileSegment
from kvpool.transfer.gpu import cuda_runtime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench script
from bench_tier import drop_cache  # one page-cache dropper for bench and check

# transport options to try, e.g. '{"posix": {"pipeline_depth": 1}, "gds": {"threads": 1}}'
_OPTIONS: dict[str, dict[str, Any]] = json.loads(os.environ.get("KVPOOL_GPU_TIER_OPTIONS") or "{}")
CHUNK = 16 << 20
BATCH = 16  # 256 MiB per pass
ITERS = 3


def _gds_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia-fs") or os.path.exists("/sys/module/nvidia_fs")


def _disk_limit(path: str, total: int) -> dict[str, float]:
    """O_DIRECT pwrite/pread of ``total`` bytes in CHUNK requests (host buffer)."""
    mm = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf[:] = 7
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    out: dict[str, float] = {}
    try:
        os.posix_fallocate(fd, 0, total)
        for op in ("write", "read"):
            best = 0.0
            for _ in range(ITERS):
                if op == "read":
                    drop_cache(fd)
                t0 = time.perf_counter()
                for i in range(total // CHUNK):
                    if op == "write":
                        os.pwritev(fd, [buf.data], i * CHUNK)
                    else:
                        os.preadv(fd, [buf.data], i * CHUNK)
                if op == "write":
                    os.fdatasync(fd)
                best = max(best, total / (time.perf_counter() - t0) / 1e9)
            out[op] = round(best, 3)
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def store_get_into(base: str, host_src: np.ndarray, dst: Any, same: Any,
                   clear: Any) -> dict[str, Any]:
    """Put ``host_src`` as CHUNK-sized disk-only objects through a master +
    node daemon with a disk tier, then ``get_into`` each into ``dst`` (any
    buffer the store takes: a GPU tensor here, a host array in the tests) at
    its offset, cold; ``same()`` compares dst with the source, ``clear()``
    zeroes dst. Returns {gbps, correct, errors}."""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
    from kvpool.store import Client, ClientConfig, ReplicateConfig

    total = host_src.nbytes
    n = total // CHUNK
    disk_dir = os.path.join(base, "store-disk")
    disk_cfg = ReplicateConfig(replica_num=0, disk_replica_num=1)
    best, ok, errors = 0.0, True, []
    with MasterProcess(data_dir=os.path.join(base, "master")) as m, \
            NodeDaemonProcess(m.address, "64MiB", extra_args=[
                "--disk-dir", disk_dir, "--disk", str(total + (64 << 20))]), \
            Client(ClientConfig(master_address=m.address, transfer_timeout_s=300)) as c:
        fd = os.open(os.path.join(disk_dir, "kvpool-segment.kvseg"), os.O_RDONLY)
        try:
            views = [dst[i * CHUNK:(i + 1) * CHUNK] for i in range(n)]
            keys = [f"gpu-tier-{i}" for i in range(n)]
            for i, k in enumerate(keys):
                c.put(k, host_src[i * CHUNK:(i + 1) * CHUNK], disk_cfg)
            for _ in range(ITERS):  # each object is read once per pass: never promoted
                clear()
                drop_cache(fd)
                t0 = time.perf_counter()
                for i, k in enumerate(keys):
                    try:
                        ok = c.get_into(k, views[i]) == CHUNK and ok
                    except Exception as exc:
                        ok = False
                        errors.append(f"{k}: {exc}")
                best = max(best, total / (time.perf_counter() - t0) / 1e9)
                ok = ok and bool(same())
        finally:
            os.close(fd)
    return {"gbps": round(best, 3), "correct": ok, "errors": errors[:3]}


def _gpu_lib() -> tuple[str, Any] | None:
    try:
        import torch

        if torch.cuda.is_available():
            return "torch", torch
    except Exception as exc:
        print(f"torch unavailable: {exc}")
    try:
        import cupy

        if cupy.cuda.is_available():
            return "cupy", cupy
    except Exception as exc:
        print(f"cupy unavailable: {exc}")
    return None


def run(report: dict[str, Any]) -> None:
    """Record results under ``report["tier"]``; prints a summary."""
    res: dict[str, Any] = {}
    report["tier"] = res
    rt, reason = cuda_runtime()
    if rt is None:
        res["skipped"] = reason
        print(f"tier GPU check skipped: {reason}")
        return
    found = _gpu_lib()
    if found is None:
        res["skipped"] = "neither torch nor cupy with CUDA is importable"
        print(res["skipped"])
        return
    lib_name, lib = found
    total = CHUNK * BATCH
    base = tempfile.mkdtemp(prefix="kvpool-gpu-tier-", dir="/var/tmp")
    engine = TransferEngine(load_transfer_config(overrides={"transports": {
        "gds": {"timeout_s": 300, "options": dict(_OPTIONS.get("gds", {}))},
        "posix": {"timeout_s": 300, "options": dict(_OPTIONS.get("posix", {}))}}}),
        "gpu-tier")
    seg = FileSegment.open(base, total)
    rows: list[dict[str, Any]] = []
    try:
        res["gds_driver"] = _gds_driver()
        gds_ok, gds_why = engine.transports().get("gds", (False, "not configured"))
        gds = engine.transport("gds")
        res["kvikio_compat_mode"] = gds.stats().get("compat_mode") if gds else None
        res["kvikio_threads"] = gds.stats().get("kvikio_threads") if gds else None
        posix = engine.transport("posix")
        res["posix_pipeline_depth"] = getattr(posix, "pipeline_depth", None)
        res["statement"] = (
            "GPUDirect Storage driver (nvidia-fs) present" if res["gds_driver"] else
            "no GPUDirect Storage driver (nvidia-fs) on this machine: kvikio runs in its "
            "POSIX compatibility mode (host bounce buffers)")
        if not gds_ok:
            res["gds_unavailable"] = gds_why
        print(f"gds: {'available' if gds_ok else 'unavailable: ' + gds_why}; kvikio "
              f"compat_mode={res['kvikio_compat_mode']} threads={res['kvikio_threads']}; posix "
              f"pipeline_depth={res['posix_pipeline_depth']}; {res['statement']}")
        res["disk_limit_gbps"] = _disk_limit(os.path.join(base, "limit.dat"), total)
        engine.add_local_segment(seg)
        if lib_name == "torch":
            g = lib.Generator(device="cuda")
            g.manual_seed(11)
            src = lib.randint(0, 256, (total,), dtype=lib.uint8, device="cuda", generator=g)
            dst = lib.zeros(total, dtype=lib.uint8, device="cuda")
            host_src = src.cpu().numpy()
        else:
            src = lib.random.RandomState(11).randint(0, 256, total,
                                                     dtype=lib.int32).astype(lib.uint8)
            dst = lib.zeros(total, dtype=lib.uint8)
            host_src = lib.asnumpy(src)
        expect = zlib.crc32(host_src.data)
        hs, hd = engine.register_buffer(src), engine.register_buffer(dst)
        for transport in ("gds", "posix"):
            if transport == "gds" and not gds_ok:
                continue
            seg.write_from(0, np.zeros(total, np.uint8))  # a WRITE must not pass on stale bytes
            for op, h in ((TransferOp.WRITE, hs), (TransferOp.READ, hd)):
                reqs = [TransferRequest(op, h, seg.segment_id, i * CHUNK, CHUNK,
                                        buffer_offset=i * CHUNK, transport=transport)
                        for i in range(BATCH)]
                best, ok, errors = 0.0, True, []
                for _ in range(ITERS):
                    if op is TransferOp.READ:
                        drop_cache(seg.io.fd)
                    t0 = time.perf_counter()
                    st = engine.transfer(reqs, timeout=300)
                    if op is TransferOp.WRITE:
                        seg.sync()
                    best = max(best, total / (time.perf_counter() - t0) / 1e9)
                    ok = ok and all(s.ok for s in st)
                    errors += [e for s in st for e in s.errors][:3]
                if op is TransferOp.WRITE:
                    back = np.empty(total, np.uint8)
                    seg.read_into(0, back)
                    correct = ok and zlib.crc32(back.data) == expect
                    if not correct:
                        seg.write_from(0, host_src)  # READ is checked on its own
                else:
                    correct = ok and (bool(lib.equal(src, dst)) if lib_name == "torch"
                                      else bool((src == dst).all()))
                    dst.fill_(0) if lib_name == "torch" else dst.fill(0)
                limit = res["disk_limit_gbps"]["read" if op is TransferOp.READ else "write"]
                rows.append({"lib": lib_name, "transport": transport, "op": op.name,
                             "gbps": round(best, 3), "ratio_vs_disk": round(best / limit, 2)
                             if limit else None, "correct": bool(correct), "errors": errors[:3]})
        try:
            dst.zero_() if lib_name == "torch" else dst.fill(0)
            got = store_get_into(
                base, host_src, dst,
                lambda: bool(lib.equal(src, dst)) if lib_name == "torch"
                else bool((src == dst).all()),
                lambda: dst.zero_() if lib_name == "torch" else dst.fill(0))
        except Exception as exc:  # report, do not lose the engine rows
            got = {"gbps": 0.0, "correct": False, "errors": [f"{type(exc).__name__}: {exc}"]}
        limit = res["disk_limit_gbps"]["read"]
        rows.append({"lib": lib_name, "transport": "store", "op": "READ", "gbps": got["gbps"],
                     "ratio_vs_disk": round(got["gbps"] / limit, 2) if limit else None,
                     "correct": bool(got["correct"]), "errors": got["errors"]})
    finally:
        engine.close()
        seg.close()
        shutil.rmtree(base, ignore_errors=True)
    res["results"] = rows
    print(f"disk limit (O_DIRECT, host buffer) GB/s: {res['disk_limit_gbps']}")
    print(f"{'lib':<6} {'transport':<9} {'op':<5} {'GB/s':>7} {'x disk':>7} correct")
    for r in rows:
        print(f"{r['lib']:<6} {r['transport']:<9} {r['op']:<5} {r['gbps']:>7.2f} "
              f"{r['ratio_vs_disk'] or '-':>7} {r['correct']}")
    res["ok"] = bool(rows) and all(r["correct"] for r in rows)


if __name__ == "__main__":
    rep: dict[str, Any] = {}
    run(rep)
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(rep, f, indent=1, default=str)
