"""Deterministic object keys for KV chunks.

A chunk is ``chunk_size`` consecutive prompt tokens (whole vLLM blocks). Its
hash is chained over every token before it: ``h_i = sha256(h_{i-1} ||
tokens_i)``, with ``h_{-1}`` derived from the key namespace, so equal hashes
mean equal prefixes. Hashes use :mod:`hashlib` (never Python's salted
``hash``) and are identical across processes and hosts.

One store object holds one chunk over every KV layer of the worker
(layer-major: for each layer, the chunk's blocks back to back)::

    kvpool/v2/<model>/<dtype>/b<block>/c<chunk>/kv<shard>of<shards>/<hash>

(``v1`` keys held one object per (chunk, layer); ``v2`` objects are larger
so a GPU moves each with one copy.)

``dtype`` is the KV format (the vLLM adapter passes dtype plus the byte
order inside a block, e.g. ``bfloat16-HNC``). ``shard`` is the KV-head
shard a tensor-parallel rank holds: ranks that hold identical bytes (KV
heads replicated when tp_size > num_kv_heads) share keys.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.core.config import ConfigError

__all__ = ["KeySpace", "chain_hashes", "kv_shard"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def kv_shard(tp_rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """``(shard, num_shards)`` of the KV heads held by ``tp_rank``.

    With ``tp_size <= num_kv_heads`` every rank holds distinct heads (shard =
    rank). With more ranks than KV heads, vLLM replicates each head over
    ``tp_size // num_kv_heads`` consecutive ranks, which then share a shard.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    if num_kv_heads < 1:
        raise ConfigError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    num_shards = min(tp_size, num_kv_heads)
    return tp_rank * num_shards // tp_size, num_shards


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray, chunk_size: int, seed: bytes, start: bytes | None = None
) -> list[str]:
    """Hex hashes of every *full* chunk of ``token_ids``, chained from ``seed``.

    ``start`` continues a chain (the raw digest of the previous chunk) so
    decode-time chunks can be hashed without rehashing the prompt.
    """
    toks = np.asarray(token_ids, dtype=np.int64)
    n = len(toks) // chunk_size
    prev = start if start is not None else hashlib.sha256(seed).digest()
    out: list[str] = []
    for i in range(n):
        h = hashlib.sha256(prev)
        h.update(toks[i * chunk_size : (i + 1) * chunk_size].astype("<i8").tobytes())
        prev = h.digest()
        out.append(prev.hex())
    return out


@dataclass(frozen=True)
class KeySpace:
    """The key namespace of one model / KV dtype / block size / chunk size / KV shard."""

    model: str
    kv_dtype: str
    block_size: int
    chunk_size: int
    shard: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} must be a positive multiple of "
                f"block_size {self.block_size}"
            )
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"bad shard {self.shard} of {self.num_shards}")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def prefix(self) -> str:
        model = _SAFE.sub("_", self.model).strip("_") or "model"
        dtype = _SAFE.sub("_", self.kv_dtype.replace("torch.", ""))
        return (
            f"kvpool/v2/{model}/{dtype}/b{self.block_size}/c{self.chunk_size}"
            f"/kv{self.shard}of{self.num_shards}"
        )

    @property
    def seed(self) -> bytes:
        """Chain seed: the model and geometry, not the shard (all shards share hashes)."""
        return f"{self.model}|{self.kv_dtype}|{self.block_size}|{self.chunk_size}".encode()

    def for_shard(self, shard: int) -> KeySpace:
        """The same namespace for another KV shard."""
        return KeySpace(self.model, self.kv_dtype, self.block_size, self.chunk_size,
                        shard, self.num_shards)

    def chunk_hashes(self, token_ids: Sequence[int] | np.ndarray) -> list[str]:
        """Hashes of the full chunks of ``token_ids`` (a trailing partial chunk is ignored)."""
        return chain_hashes(token_ids, self.chunk_size, self.seed)

    def extend_hashes(self, hashes: list[str], token_ids: Sequence[int] | np.ndarray) -> list[str]:
        """``hashes`` extended to every full chunk of ``token_ids`` (hashes is a prefix)."""
        n_full = len(token_ids) // self.chunk_size
        if n_full <= len(hashes):
            return hashes[:n_full]
        start = bytes.fromhex(hashes[-1]) if hashes else None
        tail = token_ids[len(hashes) * self.chunk_size : n_full * self.chunk_size]
        return hashes + chain_hashes(tail, self.chunk_size, self.seed, start=start)

    def chunk_key(self, chunk_hash: str) -> str:
        """Key of the object holding every layer of the chunk with hash ``chunk_hash``."""
        return f"{self.prefix}/{chunk_hash}"
