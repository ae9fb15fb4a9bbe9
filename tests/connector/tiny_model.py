"""Build a tiny random-weight Llama and a locally trained tokenizer (no downloads).

vLLM's CPU attention needs head sizes from {32, 64, 80, ...} and block sizes
that are multiples of 32; these defaults satisfy both.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_tiny_llama", "make_prompt"]

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
) -> Path:
    """Write a random Llama (safetensors) plus a WordLevel tokenizer into ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
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
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so different KV gives visibly different greedy tokens.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    # Keep generation greedy and unbounded by EOS in tests (ignore_eos is set too).
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    return out
