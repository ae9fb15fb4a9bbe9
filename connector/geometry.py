"""The registered paged KV cache as the connector stores it: layers, layer
groups, this rank's KV heads, the byte layout of an object and its key.

Built once by :meth:`CacheGeometry.from_caches` (``register_kv_caches``) and
shared, read-only, by the load pipeline (:mod:`kvpool.connector.load`), the
save queue (:mod:`kvpool.connector.save`) and the staging buffers
(:mod:`kvpool.connector.staging`). Imports torch but never vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvpool.connector.keys import KeySpace, layer_ranges
from kvpool.connector.layout import LayerLayout, ObjectLayout
from kvpool.core.config import ConfigError

__all__ = ["CacheGeometry", "HeadSpec"]

log = logging.getLogger("kvpool.connector")


@dataclass(frozen=True)
class HeadSpec:
    """The global KV heads ``[first, end)`` (of ``total``) this rank holds, and
    whether it stores them (one rank per set of identical heads)."""

    first: int = 0
    end: int = 1
    total: int = 1
    writes: bool = True

    @property
    def count(self) -> int:
        return self.end - self.first


class CacheGeometry:
    """Layers (model order; with several vLLM KV-cache groups, group after
    group), their layer groups, heads, object layout and keys.

    ``cache_sizes``: the layers of each of vLLM's KV-cache groups (default:
    one group of every layer). Each group has its own block table (a chunk's
    ``ChunkRef.block_ids`` holds ``blocks_per_chunk`` ids per group, group
    after group) and its own objects: a layer group never spans two KV-cache
    groups (:meth:`blocks` gives a layer group's block ids of a chunk)."""

    def __init__(self, layers: list[LayerLayout], heads: HeadSpec, keys: KeySpace,
                 layer_groups: int, alias: dict[str, str] | None = None,
                 cache_sizes: list[int] | None = None) -> None:
        self.layers = layers
        self.heads = heads
        self.keys = keys
        self.objects = ObjectLayout(layers, keys.blocks_per_chunk)
        sizes = cache_sizes or [len(layers)]
        if sum(sizes) != len(layers) or min(sizes) < 1:
            raise ConfigError(f"KV-cache groups of {sizes} layers for {len(layers)} layers")
        self.cache_sizes = sizes
        # per layer group: its KV-cache group, its layers there [a, b), its positions
        self.cache_of: list[int] = []
        self.group_keys: list[tuple[int, int]] = []
        self.groups: list[list[int]] = []
        start = 0
        for c, n in enumerate(sizes):
            for a, b in layer_ranges(n, layer_groups):
                self.cache_of.append(c)
                self.group_keys.append((a, b))
                self.groups.append(list(range(start + a, start + b)))
            start += n
        self.group_of: dict[str, int] = {lay.name: g for g, pos in enumerate(self.groups)
                                         for lay in (layers[p] for p in pos)}
        for name, target in (alias or {}).items():
            self.group_of[name] = self.group_of[target]
        self.device: Any = layers[0].device
        self.cuda = self.device.type == "cuda"
        self.objects.prepare_bases(self.groups, 0, heads.count)

    @property
    def num_cache_groups(self) -> int:
        return len(self.cache_sizes)

    def blocks(self, block_ids: list[int], g: int) -> list[int]:
        """Layer group ``g``'s block ids of a chunk (``ChunkRef.block_ids``)."""
        bpc = self.keys.blocks_per_chunk
        c = self.cache_of[g]
        return block_ids[c * bpc : (c + 1) * bpc]

    @classmethod
    def from_caches(cls, kv_caches: dict[str, Any], heads: HeadSpec, keys: KeySpace,
                    layer_groups: int, layer_index: dict[str, int] | None = None,
                    num_blocks: int | None = None,
                    cache_group_of: dict[str, int] | None = None) -> CacheGeometry:
        """The geometry of the paged KV tensors ``{layer_name: tensor}`` (dim 0 =
        blocks). ``layer_index``: names to layer numbers (model order; default
        the dict's order). ``num_blocks``: the scheduler's block count, when
        vLLM split blocks into smaller kernel blocks. Layers aliasing one
        tensor (KV sharing) are stored once and belong to the group of the
        layer they alias. ``cache_group_of``: each layer's vLLM KV-cache group
        (several groups: ``layer_index`` must number them group after group);
        layers of different KV-cache groups share tensors (each group indexes
        them with its own block ids) and are no aliases. A cache with one
        "head" per block (MLA) is stored as heads ``0-1 of 1``."""
        seen: dict[tuple[int, int], str] = {}
        alias: dict[str, str] = {}
        layers = []
        for i, (name, t) in enumerate(kv_caches.items()):
            ident = (t.data_ptr(), t.storage_offset())
            if ident in seen and (cache_group_of is None or name not in cache_group_of):
                alias[name] = seen[ident]
                continue
            seen.setdefault(ident, name)
            idx = layer_index[name] if layer_index is not None else i
            ratio = 1
            if num_blocks and t.shape[0] != num_blocks and t.shape[0] % num_blocks == 0:
                ratio = int(t.shape[0]) // num_blocks
            layers.append(LayerLayout.from_tensor(name, idx, t, ratio, heads.count))
        if not layers:
            raise ConfigError("no KV cache tensors to register")
        nbs = {layer.num_blocks for layer in layers}
        if len(nbs) != 1:
            raise ConfigError(f"layers disagree on num_blocks: {sorted(nbs)}")
        devs = {str(layer.device) for layer in layers}
        if len(devs) != 1:
            raise ConfigError(f"KV layers on several devices: {sorted(devs)}")
        layers.sort(key=lambda lay: lay.index)
        if layers[0].heads not in (1, heads.count):
            raise ConfigError(f"KV cache holds {layers[0].heads} heads, expected {heads.count}")
        if layers[0].heads != heads.count:  # opaque blocks (MLA): one "head"
            heads = HeadSpec(0, 1, 1, heads.writes)
        sizes = None
        if cache_group_of:
            order = [cache_group_of.get(lay.name, -1) for lay in layers]
            if order != sorted(order) or order[0] != 0:
                raise ConfigError("KV-cache groups' layers are not numbered group after group")
            sizes = [order.count(c) for c in range(order[-1] + 1)]
        geo = cls(layers, heads, keys, layer_groups, alias, sizes)
        log.info("kvpool: %d KV layers in %d groups (%d KV-cache groups), %d blocks, "
                 "heads %d-%d of %d (%s), %d-byte chunks, single-kernel copies=%s, writes=%s",
                 len(layers), len(geo.groups), geo.num_cache_groups, layers[0].num_blocks,
                 heads.first, heads.end, heads.total, geo.device, geo.chunk_bytes,
                 geo.objects.single_kernel, heads.writes)
        return geo

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all layers and this rank's heads."""
        return self.objects.object_bytes(range(len(self.layers)), self.heads.count)

    def head_bytes(self, g: int) -> int:
        """Bytes of one head of one chunk in layer group ``g``."""
        return self.objects.object_bytes(self.groups[g], 1)

    def object_key(self, chunk_hash: str, g: int, heads: tuple[int, int]) -> str:
        """Key of layer group ``g`` and global heads ``heads`` of a chunk."""
        return self.keys.object_key(chunk_hash, self.group_keys[g], heads, self.heads.total,
                                    (self.cache_of[g], len(self.cache_sizes)))

    def chunks_per_buffer(self, staging_mib: float) -> int:
        """Whole chunks (all layers) that fit one staging buffer of ``staging_mib``."""
        return max(1, int(staging_mib * (1 << 20)) // max(1, self.chunk_bytes))
