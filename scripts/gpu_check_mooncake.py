#!/usr/bin/env python3
"""GPU checks of the Mooncake-compatible API (run by the lead via scripts/gpu_check.py).

``run(report)`` starts a real master and a holder node daemon (host memory)
and uses ``kvpool.store.mooncake.MooncakeDistributedStore`` as a pure client
with CUDA memory, the way vLLM's Mooncake store connector does (GPU KV cache
registered with ``register_buffer``, then ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` of per-layer K/V block segments), and the
tensor API with CUDA tensors (``put_tensor``/``get_tensor``, TP shards,
``get_tensor_into_cuda``, ``batch_get_tensor_into_cuda``). Every byte is
compared on the GPU (torch.equal); GB/s of the multi-buffer calls are
recorded next to the single-buffer batch calls of the same bytes, over shm
(same host) and over tcp (forced by a selector override: host staging); the
first call of a fresh client is timed apart from the steady state.

Standalone: ``python scripts/gpu_check_mooncake.py [--json OUT]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

LAYERS, BLOCKS, BLOCK_BYTES, KEYS = 8, 64, 256 << 10, 32
ROUNDS = 3  # steady-state calls measured (median)
FORCE_TCP = {"rules": [{"name": "gpu-check-force-tcp", "transports": ["tcp"]}]}


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _store(master: str, transport: str) -> Any:
    from kvpool.store.mooncake import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    conf: dict[str, Any] = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                            "global_segment_size": 0, "local_buffer_size": "512MB",
                            "master_server_address": master}
    if transport == "tcp":
        conf["transfer_overrides"] = FORCE_TCP
    assert s.setup(conf) == 0, "setup failed"
    return s


def _multi_buffer(torch: Any, master: str, transport: str, out: dict[str, Any]) -> None:
    """vLLM's save/load: K/V-first per-layer caches on the GPU, one key per block.

    The first multi-buffer put and get of the fresh client are timed apart
    (``<t>_multi_first_put_ms``: one-time preparation such as page-locking the
    holder's mapping may still run); the GB/s are the median of ROUNDS calls
    after it, for the multi-buffer calls and the single-buffer ones alike."""
    s = _store(master, transport)
    try:
        dev = torch.device("cuda:0")
        src = [torch.randint(0, 255, (2, BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device=dev)
               for _ in range(LAYERS)]
        dst = [torch.zeros_like(t) for t in src]
        for t in src + dst:
            assert s.register_buffer(t.data_ptr(), t.numel()) == 0
        torch.cuda.synchronize()

        def block(cache: list[Any], b: int) -> tuple[list[int], list[int]]:
            addrs = [t.data_ptr() + kv * BLOCKS * BLOCK_BYTES + b * BLOCK_BYTES
                     for t in cache for kv in range(2)]
            return addrs, [BLOCK_BYTES] * len(addrs)

        per_key = 2 * LAYERS * BLOCK_BYTES
        first = block(src, BLOCKS - 1)
        t = time.perf_counter()
        assert s.batch_put_from_multi_buffers([f"{transport}/first"], [first[0]],
                                              [first[1]]) == [0]
        out[f"{transport}_multi_first_put_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        back = block(dst, BLOCKS - 1)
        t = time.perf_counter()
        assert s.batch_get_into_multi_buffers([f"{transport}/first"], [back[0]],
                                              [back[1]]) == [per_key]
        out[f"{transport}_multi_first_get_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][:, -1], src[layer][:, -1]), layer
        puts, gets = [], []
        for r in range(ROUNDS):
            for d in dst:
                d.zero_()
            torch.cuda.synchronize()
            keys = [f"{transport}/mb/{r}/{b}" for b in range(KEYS)]
            addrs, sizes = zip(*(block(src, b) for b in range(KEYS)), strict=True)
            t = time.perf_counter()
            res = s.batch_put_from_multi_buffers(keys, list(addrs), list(sizes))
            puts.append(time.perf_counter() - t)
            assert res == [0] * KEYS, res
            daddrs, dsizes = zip(*(block(dst, KEYS + b) for b in range(KEYS)), strict=True)
            t = time.perf_counter()
            res = s.batch_get_into_multi_buffers(keys, list(daddrs), list(dsizes))
            gets.append(time.perf_counter() - t)
            assert res == [per_key] * KEYS, res
            torch.cuda.synchronize()
            for layer in range(LAYERS):
                assert torch.equal(dst[layer][:, KEYS:2 * KEYS], src[layer][:, :KEYS]), layer
            s.remove_all(True)
        out[f"{transport}_multi_put_gbps"] = _gbps(KEYS * per_key, statistics.median(puts))
        out[f"{transport}_multi_get_gbps"] = _gbps(KEYS * per_key, statistics.median(gets))
        # the same bytes as one contiguous buffer per key
        flat = torch.randint(0, 255, (KEYS, per_key), dtype=torch.uint8, device=dev)
        back_t = torch.zeros_like(flat)
        for t2 in (flat, back_t):
            assert s.register_buffer(t2.data_ptr(), t2.numel()) == 0
        torch.cuda.synchronize()
        puts, gets = [], []
        for r in range(ROUNDS):
            back_t.zero_()
            torch.cuda.synchronize()
            ks = [f"{transport}/one/{r}/{b}" for b in range(KEYS)]
            t = time.perf_counter()
            assert s.batch_put_from(ks, [flat[b].data_ptr() for b in range(KEYS)],
                                    [per_key] * KEYS) == [0] * KEYS
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert s.batch_get_into(ks, [back_t[b].data_ptr() for b in range(KEYS)],
                                    [per_key] * KEYS) == [per_key] * KEYS
            gets.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            assert torch.equal(flat, back_t)
            s.remove_all(True)
        out[f"{transport}_single_put_gbps"] = _gbps(KEYS * per_key, statistics.median(puts))
        out[f"{transport}_single_get_gbps"] = _gbps(KEYS * per_key, statistics.median(gets))
    finally:
        s.close()


def _tensors(torch: Any, master: str, out: dict[str, Any]) -> None:
    s = _store(master, "shm")
    try:
        dev = torch.device("cuda:0")
        t = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
        assert s.put_tensor("gpu/t", t) == 0
        got = s.get_tensor("gpu/t")  # Mooncake returns host tensors
        assert got is not None and torch.equal(got.to(dev), t)
        assert s.put_tensor_with_tp("gpu/tp", t, 0, 4, 1) == 0
        shard = s.get_tensor_with_tp("gpu/tp", 2, 4)
        assert torch.equal(shard.to(dev), t[:, 512:768])
        dst = torch.zeros_like(t)
        assert s.get_tensor_into_cuda("gpu/t", dst) == t.numel() * 2
        assert torch.equal(dst, t)
        dsts = [torch.zeros(256, 256, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        res = s.batch_get_tensor_into_cuda([f"gpu/tp_tp_{r}" for r in range(4)], dsts)
        assert res == [256 * 256 * 2] * 4, res
        assert torch.equal(torch.cat(dsts, 1), t)
        out["tensor_api"] = "ok"
        s.remove_all(True)
    finally:
        s.close()


def run(report: dict[str, Any]) -> None:
    import torch

    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    if not torch.cuda.is_available():
        report["status"] = "skipped: no CUDA device"
        return
    with MasterProcess() as master, NodeDaemonProcess(master.address, "4GiB"):
        for transport in ("shm", "tcp"):
            _multi_buffer(torch, master.address, transport, report)
        _tensors(torch, master.address, report)
    for tr in ("shm", "tcp"):
        for op in ("put", "get"):
            single = report.get(f"{tr}_single_{op}_gbps") or 0
            if single:
                report[f"{tr}_{op}_multi_to_single"] = round(
                    report[f"{tr}_multi_{op}_gbps"] / single, 3)


if __name__ == "__main__":
    section: dict[str, Any] = {}
    run(section)
    text = json.dumps(section, indent=2)
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            f.write(text)
    print(text)
