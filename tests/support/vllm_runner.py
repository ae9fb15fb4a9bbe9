"""A vLLM engine in its own process, driven by JSON lines (used by the e2e tests
and scripts/bench_vllm.py through :class:`support.vllm_engine.EngineProc`).

    python tests/support/vllm_runner.py '<json engine config>'

stdin: one JSON command per line, ``{"prompts": [...], "max_tokens": N}``,
``{"reset_prefix_cache": true}`` (vLLM's own prefix cache emptied) or
``{"quit": true}``. stdout: one line per command, ``@@KVPOOL@@ {json}`` with
the generated token ids, finish reason, prompt token ids, time to first token
per prompt, the connector's counters (scheduler and worker side, totals since
start) and the scheduler's ``kv_load_failure_policy``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MARK = "@@KVPOOL@@ "


def _connector_totals(llm: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    out: dict[str, Any] = {}
    core = llm.llm_engine.engine_core
    sched = getattr(getattr(core, "engine_core", None), "scheduler", None)
    conn = getattr(sched, "connector", None)
    if conn is not None and hasattr(conn, "stats"):
        out["scheduler"] = conn.stats.totals()
        out["kv_load_failure_policy"] = sched.vllm_config.kv_transfer_config.kv_load_failure_policy
    if has_kv_transfer_group():
        w: Any = get_kv_transfer_group()
        if getattr(w, "_worker", None) is not None:
            w._worker.wait_saves(timeout=60)
            out["worker"] = w.stats.totals()
    return out


def _reset_prefix_cache(llm: Any, timeout_s: float = 30.0) -> bool:
    """Empty vLLM's prefix cache. Finished requests whose blocks wait for the
    connector's saves hold them until an engine step sees the saves done (a
    served engine steps on its own; this one steps only when driven): step
    until the reset succeeds."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.01)
    return True


def main() -> None:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=cfg["model"], dtype="bfloat16", block_size=cfg.get("block_size", 32),
        max_model_len=cfg.get("max_model_len", 2048), enforce_eager=True,
        enable_prefix_caching=cfg.get("prefix_caching", True),
        kv_cache_memory_bytes=cfg.get("kv_cache_bytes", 256 << 20),
        max_num_batched_tokens=cfg.get("max_num_batched_tokens", 8192),
        # vLLM's CPU platform keeps a linear-attention (GDN) recurrent state in
        # float32 where the CPU has AVX512-BF16 and in the model's dtype where
        # it has not: named here, the state's size (so vLLM's block size) is
        # the same on every machine
        mamba_ssm_cache_dtype=cfg.get("mamba_ssm_cache_dtype", "float32"),
        seed=0,
    )
    if cfg.get("tensor_parallel_size", 1) > 1:
        kw["tensor_parallel_size"] = cfg["tensor_parallel_size"]
        kw["distributed_executor_backend"] = "mp"
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
    llm = LLM(**kw)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd.get("reset_prefix_cache"):  # forget the engine's own cached blocks
            print(MARK + json.dumps({"reset": _reset_prefix_cache(llm)}), flush=True)
            continue
        sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True)
        results = []
        for prompt in cmd["prompts"]:  # one at a time: per-prompt TTFT
            t0 = time.perf_counter()
            ttft_sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            if cmd.get("ttft"):
                out1 = llm.generate([prompt], ttft_sp, use_tqdm=False)[0]
                ttft = time.perf_counter() - t0
                results.append({"prompt_token_ids": list(out1.prompt_token_ids or []),
                                "token_ids": list(out1.outputs[0].token_ids), "ttft_s": ttft,
                                "finish_reason": out1.outputs[0].finish_reason})
                continue
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            results.append({"prompt_token_ids": list(out.prompt_token_ids or []),
                            "token_ids": list(out.outputs[0].token_ids),
                            "finish_reason": out.outputs[0].finish_reason,
                            "latency_s": time.perf_counter() - t0})
        print(MARK + json.dumps({"results": results, "connector": _connector_totals(llm)}),
              flush=True)
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    print(MARK + json.dumps({"bye": True, "shutdown_s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
    # The engine is shut down; skip the interpreter's slow teardown of torch/vLLM.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
