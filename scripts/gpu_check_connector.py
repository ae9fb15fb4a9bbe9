#!/usr/bin/env python3
"""GPU check of the vLLM connector's worker side (run by scripts/gpu_check.py).

Without vLLM: allocates paged KV caches in vLLM 0.32's CUDA layout (one bf16
backing allocation, LBNHC: per layer ``[num_blocks, block, kv_heads,
2*head]`` physical, viewed ``[num_blocks, kv_heads, block, 2*head]``), then
saves chunks through :class:`kvpool.connector.worker.KVPoolWorker` to a
``kvpool client`` node daemon on this machine and loads them into other
blocks, consecutive and scattered. Each chunk is one object over all
layers: its blocks are gathered on the GPU into a staging tensor (one
index_select) and moved with one cudaMemcpy into the daemon's shm segment;
loads copy into staging and index_copy_ into the blocks. The worker warms
the copy path (segment mapping + cudaHostRegister) when it connects, before
the timed runs; that one-time time is reported as ``warmup_s``.
Verifies the loaded bytes on the GPU and reports GB/s next to pinned
cudaMemcpy H2D/D2H measured in the same run (target: >= 0.8x).

Standalone: ``python scripts/gpu_check_connector.py [--json OUT] [--layers 32]
[--staging-mib 512] [--repeat 2]`` (``--device cpu``: a dry run without a GPU).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.keys import KeySpace
from kvpool.connector.metadata import ChunkRef, LoadSpec, SaveSpec
from kvpool.connector.store_access import StoreAccess
from kvpool.connector.worker import KVPoolWorker

DEFAULTS: dict[str, Any] = dict(layers=32, blocks=2048, block=16, heads=8, head=128,
                                chunk_tokens=(256, 1024), stored_gib=1.0, device="cuda",
                                staging_mib=(512,), repeat=2)


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pinned(torch: Any, nbytes: int, piece: int, iters: int = 3,
            device: str = "cuda") -> dict[str, float]:
    """Pinned cudaMemcpy GB/s (H2D, D2H) moving ``nbytes`` in ``piece``-byte copies
    (device "cpu": plain memcpy, for a dry run without a GPU)."""
    n = max(1, nbytes // piece)
    host = torch.empty(n * piece, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(n * piece, dtype=torch.uint8, device=device)
    out = {}
    for name in ("h2d", "d2h"):
        _sync(torch, device)
        t0 = time.perf_counter()
        for _ in range(iters):
            for i in range(n):
                s = slice(i * piece, (i + 1) * piece)
                if name == "h2d":
                    dev[s].copy_(host[s])
                else:
                    host[s].copy_(dev[s])
            _sync(torch, device)
        out[name] = n * piece * iters / (time.perf_counter() - t0) / 1e9
    del host, dev
    return out


def _check_one(torch: Any, w: KVPoolWorker, kv: Any, chunk_tokens: int, block: int,
               n_chunks: int, scattered: bool, seed: int, device: str,
               repeat: int = 1) -> dict[str, Any]:
    """Save ``n_chunks`` chunks and load them into other blocks ``repeat`` times
    (the store emptied in between); GB/s of the best round, every round listed."""
    rounds = []
    for i in range(repeat):
        rounds.append(_round(torch, w, kv, chunk_tokens, block, n_chunks, scattered,
                             seed + 1000 * i, device))
        w.store.call(lambda c: c.remove_all(force=True))
    best = dict(rounds[0])
    best["save_GBps"] = max(r["save_GBps"] for r in rounds)
    best["load_GBps"] = max(r["load_GBps"] for r in rounds)
    best["bytes_equal"] = all(r["bytes_equal"] for r in rounds)
    best["failed_blocks"] = sum(r["failed_blocks"] for r in rounds)
    best["rounds"] = [{k: round(r[k], 4) for k in ("save_GBps", "load_GBps", "save_s",
                                                  "save_store_s", "load_s", "load_store_s")}
                      for r in rounds]
    return best


def _round(torch: Any, w: KVPoolWorker, kv: Any, chunk_tokens: int, block: int,
           n_chunks: int, scattered: bool, seed: int, device: str) -> dict[str, Any]:
    bpc = chunk_tokens // block
    nb = kv.shape[1]
    need = n_chunks * bpc
    g = torch.Generator().manual_seed(seed)
    if scattered:
        perm = torch.randperm(nb, generator=g).tolist()
        src_ids, dst_ids = perm[:need], perm[need : 2 * need]
    else:
        src_ids, dst_ids = list(range(need)), list(range(need, 2 * need))
    toks = torch.randint(0, 50000, (n_chunks * chunk_tokens,), generator=g).tolist()
    hashes = w.keys.chunk_hashes(toks)
    src = [ChunkRef(i, h, src_ids[i * bpc : (i + 1) * bpc]) for i, h in enumerate(hashes)]
    dst = [ChunkRef(i, h, dst_ids[i * bpc : (i + 1) * bpc]) for i, h in enumerate(hashes)]
    nbytes = n_chunks * w.chunk_bytes
    # time spent inside store calls (RPCs + copies); the rest is gather/scatter
    store_s = [0.0]
    calls = [0]
    orig = w.store.call

    def timed(fn: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(fn)
        finally:
            store_s[0] += time.perf_counter() - t
            calls[0] += 1

    w.store.call = timed  # type: ignore[method-assign]
    try:
        _sync(torch, device)
        t0 = time.perf_counter()
        written = w.save([SaveSpec("gpu-check", src)])
        t_save = time.perf_counter() - t0
        save_store_s, save_calls = store_s[0], calls[0]
        store_s[0], calls[0] = 0.0, 0
        t0 = time.perf_counter()
        res = w.load(LoadSpec("gpu-check", dst))
        _sync(torch, device)
        t_load = time.perf_counter() - t0
    finally:
        w.store.call = orig  # type: ignore[method-assign]
    s_idx = torch.tensor(src_ids, device=device)
    d_idx = torch.tensor(dst_ids, device=device)
    ok = bool(torch.equal(kv.index_select(1, s_idx), kv.index_select(1, d_idx)))
    return {
        "chunk_tokens": chunk_tokens, "chunks": n_chunks, "scattered": scattered,
        "bytes": nbytes, "object_bytes": w.chunk_bytes,
        "written_chunks": written, "loaded_chunks": res.loaded_chunks,
        "failed_blocks": len(res.failed_block_ids), "bytes_equal": ok,
        "save_GBps": nbytes / t_save / 1e9, "load_GBps": nbytes / t_load / 1e9,
        "save_s": t_save, "save_store_s": save_store_s, "save_store_calls": save_calls,
        "load_s": t_load, "load_store_s": store_s[0], "load_store_calls": calls[0],
    }


def run(report: dict[str, Any], **overrides: Any) -> None:
    """Record results under ``report["connector"]``; prints a summary line per case."""
    p = {**DEFAULTS, **overrides}
    res: dict[str, Any] = {"params": {k: v for k, v in p.items()}}
    report["connector"] = res
    try:
        import torch
    except ImportError as exc:
        res["skipped"] = f"torch unavailable: {exc}"
        return
    device = p["device"]
    if device == "cuda" and not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
        return
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    L, B, N, H, C = p["layers"], p["blocks"], p["block"], p["heads"], 2 * p["head"]
    # vLLM 0.32 CUDA default layout LBNHC: [L, B, N, H, C] physical.
    kv = torch.randn(L, B, N, H, C, dtype=torch.bfloat16, device=device)
    caches = {f"model.layers.{i}.self_attn.attn": kv[i].permute(0, 2, 1, 3) for i in range(L)}
    kv_bytes = kv.view(torch.uint8).view(L, B, -1)  # per layer, per block, opaque bytes
    page = N * H * C * 2
    store_bytes = int(p["stored_gib"] * (1 << 30))
    pool_bytes = int(store_bytes * 2.5) + (64 << 20)
    mibs = p["staging_mib"]
    mibs = [mibs] if isinstance(mibs, int | float) else list(mibs)
    with MasterProcess() as m, NodeDaemonProcess(m.address, memory=pool_bytes,
                                                 start_timeout_s=120) as _d:
        for ct, mib in [(ct, mib) for ct in p["chunk_tokens"] for mib in mibs]:
            n_chunks = max(1, store_bytes // (L * page * (ct // N)))
            if 2 * n_chunks * (ct // N) > B:
                n_chunks = B // (2 * (ct // N))
            ks = KeySpace("gpu-check", "bfloat16", N, ct)
            cfg = ConnectorConfig(master_address=m.address, chunk_size=ct,
                                  staging_mib=mib)
            w = KVPoolWorker(cfg, ks, StoreAccess(cfg))
            w.register_kv_caches(caches)
            res.setdefault("warmup_s", []).append(w.warmup_s)
            try:
                for scattered in (False, True):
                    r = _check_one(torch, w, kv_bytes, ct, N, n_chunks, scattered, ct,
                                   device, p["repeat"])
                    r["staging_mib"] = mib
                    r["single_kernel_gather"] = bool(w.chunk_layout
                                                     and w.chunk_layout.single_kernel)
                    pin = _pinned(torch, r["bytes"], r["object_bytes"], device=device)
                    r["pinned_GBps"] = pin
                    r["save_vs_pinned_d2h"] = r["save_GBps"] / pin["d2h"]
                    r["load_vs_pinned_h2d"] = r["load_GBps"] / pin["h2d"]
                    res.setdefault("cases", []).append(r)
                    print(f"connector chunk={ct} staging={mib}MiB scattered={scattered}: save "
                          f"{r['save_GBps']:.1f}"
                          f" GB/s ({r['save_vs_pinned_d2h']:.2f}x pinned D2H), load "
                          f"{r['load_GBps']:.1f} GB/s ({r['load_vs_pinned_h2d']:.2f}x pinned H2D),"
                          f" bytes_equal={r['bytes_equal']} rounds={r['rounds']}")
            finally:
                w.close()
                w.store.close()
    big = _pinned(torch, min(1 << 30, 4 * store_bytes), 64 << 20, device=device)
    res["pinned_64MiB_GBps"] = big
    cases = res.get("cases", [])
    res["all_bytes_equal"] = all(c["bytes_equal"] and not c["failed_blocks"] for c in cases)
    best = max(cases, key=lambda c: min(c["save_GBps"], c["load_GBps"]), default=None)
    if best:
        res["best_vs_pinned"] = {"save": best["save_GBps"] / big["d2h"],
                                 "load": best["load_GBps"] / big["h2d"],
                                 "chunk_tokens": best["chunk_tokens"]}
    if not res["all_bytes_equal"]:
        res["status"] = report["status"] = "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    ap.add_argument("--blocks", type=int, default=DEFAULTS["blocks"])
    ap.add_argument("--stored-gib", type=float, default=DEFAULTS["stored_gib"])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--staging-mib", type=float, nargs="+", default=DEFAULTS["staging_mib"],
                    help="staging buffer sizes to run (MiB each)")
    ap.add_argument("--repeat", type=int, default=DEFAULTS["repeat"])
    a = ap.parse_args()
    report: dict[str, Any] = {}
    run(report, layers=a.layers, blocks=a.blocks, stored_gib=a.stored_gib, device=a.device,
        staging_mib=a.staging_mib, repeat=a.repeat)
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
