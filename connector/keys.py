"""Deterministic object keys for KV chunks.

A chunk is ``chunk_size`` consecutive prompt tokens (whole vLLM blocks). Its
hash is chained over every token before it: ``h_i = sha256(h_{i-1} ||
tokens_i)``, with ``h_{-1}`` derived from the key namespace, so equal hashes
mean equal prefixes. Hashes use :mod:`hashlib` (never Python's salted
``hash``) and are identical across processes and hosts.

One store object holds one chunk for one layer group and one range of KV
heads (head-major, see :mod:`kvpool.connector.layout`)::

    kvpool/v3/<model>/<dtype>/b<block>/c<chunk>[/g<group>of<groups>]/l<first>-<end>/h<first>-<end>of<heads>/<hash>

A recurrent state (Mamba / linear attention: a KV-cache group holding one
state per sequence instead of per-token KV) is stored per chunk boundary
whose state vLLM checkpointed, one object per layer and tensor-parallel
rank (a rank holds its own heads' state; only an engine with the same TP
size reads it)::

    kvpool/v3/<model>/<dtype>/b<block>/c<chunk>/s<group>/l<layer>/r<rank>of<ranks>/<hash>

where ``<hash>`` is the hash of the chunk the state ends, ``s<group>`` the
state group (vLLM's state KV-cache groups, numbered apart from the others).

``g<group>of<groups>``: vLLM's KV-cache group (hybrid models: full-attention
and sliding-window layers are separate groups, each with its own block
table); absent when the model has one group. Layer numbers are positions
inside that group (:class:`CacheGroup`).

Layer groups split the model's layers into ``layer_groups`` runs, the first
one short and the others equal (see :func:`layer_ranges`): a load waits
only for the group of the layer about to run. Head ranges are
global KV-head indices: a TP=2 engine writes ``h0-4of8`` and ``h4-8of8``, a
TP=1 engine ``h0-8of8``, and either reads the other's (see
:func:`head_ranges`); MLA caches have one latent per token, the same on every
rank, stored as ``h0-1of1`` by one rank. ``dtype`` is the KV format (the vLLM
adapter passes dtype plus the byte order inside a block, e.g. ``bfloat16-HNC``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvpool.core.config import ConfigError

__all__ = ["CacheGroup", "KeySpace", "chain_hashes", "first_window_block", "head_granularities",
           "head_ranges", "kv_shard", "layer_ranges", "rank_heads"]

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


def rank_heads(tp_rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int, bool]:
    """``(first, end, writes)``: the global KV heads ``[first, end)`` that
    ``tp_rank`` holds, and whether it is the one rank that stores them (ranks
    holding replicated heads, or an MLA latent, have identical bytes)."""
    shard, shards = kv_shard(tp_rank, tp_size, num_kv_heads)
    if num_kv_heads % shards:
        raise ConfigError(f"{num_kv_heads} KV heads do not split over {shards} ranks")
    per = num_kv_heads // shards
    ranks_per_shard = tp_size // shards
    return shard * per, (shard + 1) * per, tp_rank % ranks_per_shard == 0


def head_ranges(num_kv_heads: int, objects: int) -> list[tuple[int, int]]:
    """The head ranges of a chunk stored as ``objects`` objects (one per rank
    of a writer with ``objects`` distinct shards)."""
    per = num_kv_heads // objects
    return [(i * per, (i + 1) * per) for i in range(objects)]


def head_granularities(num_kv_heads: int, own: int) -> list[int]:
    """Object counts per chunk (and layer group) a reader looks for: its own
    first, then every other split a writer with TP 1, 2, 4, 8, ... makes."""
    out = [own]
    k = 1
    while k <= num_kv_heads:
        if num_kv_heads % k == 0 and k not in out:
            out.append(k)
        k *= 2
    return out


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV-cache groups as kvpool stores it: its layer count and,
    for a sliding-window group, the tokens it keeps behind the next one
    (vLLM's ``sliding_window + extra_retained_tokens``); None = full
    attention. ``state``: the group holds recurrent state, not KV."""

    num_layers: int
    window: int | None = None
    #: a recurrent state group (Mamba / linear attention), stored per
    #: checkpointed boundary (:meth:`KeySpace.state_key`), not per chunk
    state: bool = False


def first_window_block(end_tokens: int, window: int | None, block_size: int) -> int:
    """The first block of a group that a sequence of ``end_tokens`` computed tokens
    still holds: 0 for full attention; for a sliding window, the blocks before
    it are outside the window (vLLM's ``get_num_skipped_tokens`` frees them and
    gives a hit null blocks there)."""
    if window is None:
        return 0
    return max(0, end_tokens - window + 1) // block_size


def layer_ranges(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` runs of layers ``[first, end)`` covering ``0 .. num_layers``,
    short ones first: 1 layer, then 2, 4, ... while below an even share and
    while the runs left stay within 1.25 even shares; then equal runs (32
    layers in 8 groups: 1, 2, 4, 5, 5, 5, 5, 5; in 4: 8, 8, 8, 8). A
    layer-wise load waits for the first group with nothing to compute beside
    it, and for each later one only as long as its load outlasts the compute
    of the groups before it: short first groups are what keeps both small."""
    g = max(1, min(groups, num_layers))
    even = num_layers / g
    out: list[tuple[int, int]] = []
    start, size = 0, 1
    while len(out) < g - 1 and size < even and \
            num_layers - start - size <= 1.25 * even * (g - len(out) - 1):
        out.append((start, start + size))
        start, size = start + size, size * 2
    left, n = num_layers - start, g - len(out)
    out += [(start + i * left // n, start + (i + 1) * left // n) for i in range(n)]
    return out


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
    """The key namespace of one model / KV format / block size / chunk size."""

    model: str
    kv_dtype: str
    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} must be a positive multiple of "
                f"block_size {self.block_size}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @cached_property  # built once: a load names hundreds of object keys
    def prefix(self) -> str:
        model = _SAFE.sub("_", self.model).strip("_") or "model"
        dtype = _SAFE.sub("_", self.kv_dtype.replace("torch.", ""))
        return f"kvpool/v3/{model}/{dtype}/b{self.block_size}/c{self.chunk_size}"

    @property
    def seed(self) -> bytes:
        """Chain seed: the model and geometry (every object of a chunk shares its hash)."""
        return f"{self.model}|{self.kv_dtype}|{self.block_size}|{self.chunk_size}".encode()

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

    def object_key(self, chunk_hash: str, layers: tuple[int, int], heads: tuple[int, int],
                   num_heads: int, cache_group: tuple[int, int] = (0, 1)) -> str:
        """Key of the object holding layers ``[layers)`` and global KV heads
        ``[heads)`` (of ``num_heads``) of the chunk with hash ``chunk_hash``;
        ``cache_group``: (group, groups) of vLLM's KV-cache groups (named in the
        key only when there are several)."""
        g = f"/g{cache_group[0]}of{cache_group[1]}" if cache_group[1] > 1 else ""
        return (f"{self.prefix}{g}/l{layers[0]}-{layers[1]}/h{heads[0]}-{heads[1]}of{num_heads}"
                f"/{chunk_hash}")

    def chunk_keys(self, chunk_hash: str, num_layers: int, layer_groups: int,
                   num_heads: int = 1, split: int = 1,
                   cache_group: tuple[int, int] = (0, 1)) -> list[str]:
        """Every object key of a chunk of a ``num_layers``-layer model (or KV-cache
        group ``cache_group``) stored in ``layer_groups`` layer groups by a
        writer with ``split`` head shards."""
        return [self.object_key(chunk_hash, lr, hr, num_heads, cache_group)
                for lr in layer_ranges(num_layers, layer_groups)
                for hr in head_ranges(num_heads, split)]

    def state_key(self, chunk_hash: str, group: int, layer: int, rank: int, ranks: int) -> str:
        """Key of the recurrent state of layer ``layer`` of state group ``group``
        held by tensor-parallel rank ``rank`` of ``ranks``, after the chunk
        with hash ``chunk_hash`` (the state of its prefix)."""
        return f"{self.prefix}/s{group}/l{layer}/r{rank}of{ranks}/{chunk_hash}"

    def state_keys(self, chunk_hash: str, group: int, num_layers: int, ranks: int) -> list[str]:
        """Every object of a state group's state after chunk ``chunk_hash``:
        each layer of each rank (a load needs them all)."""
        return [self.state_key(chunk_hash, group, j, r, ranks)
                for r in range(ranks) for j in range(num_layers)]

    def state_probe_keys(self, chunk_hash: str, group: int, num_layers: int,
                         ranks: int) -> list[str]:
        """The objects a lookup asks for to learn whether that state is
        stored: each rank's last layer (ranks save apart; one rank's layers
        are put in one batch and read together, so they are evicted
        together: a state found incomplete by its load fails that load)."""
        return [self.state_key(chunk_hash, group, num_layers - 1, r, ranks)
                for r in range(ranks)]
