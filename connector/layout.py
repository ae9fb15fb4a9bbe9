"""Byte-level views of vLLM's paged KV cache, independent of the attention backend.

vLLM 0.32 hands the connector one tensor per layer, a ``[num_blocks, ...]``
view (CPU: ``[num_blocks, kv_heads, block_size, 2*head_size]``; CUDA
backends use other interiors and may interleave layers, e.g. block-outermost
layouts). The connector never looks inside a block: a block of a layer is
``block_bytes`` opaque bytes at ``base + b * block_stride`` in the layer's
backing storage. :class:`LayerLayout` is that description plus a
``[num_blocks, block_bytes]`` uint8 view used to move whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.master.common import ConfigError

__all__ = ["LayerLayout", "consecutive_run"]


def consecutive_run(block_ids: list[int]) -> bool:
    """True when ``block_ids`` are ``b, b+1, ..., b+n-1`` (one contiguous range)."""
    return all(block_ids[i + 1] == block_ids[i] + 1 for i in range(len(block_ids) - 1))


@dataclass
class LayerLayout:
    """One layer's paged KV cache as whole opaque blocks.

    ``blocks`` is a uint8 view ``[num_blocks, block_bytes]`` (strided when
    blocks are not adjacent); ``storage`` is a flat uint8 tensor over the
    whole backing allocation (what gets registered for zero-copy);
    ``dense`` is True when block ``b + 1`` starts right after block ``b``, so a
    run of consecutive blocks is one contiguous byte range.
    """

    name: str
    index: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    offset: int
    blocks: Any
    storage: Any

    @property
    def dense(self) -> bool:
        return self.block_stride == self.block_bytes

    @property
    def device(self) -> Any:
        return self.blocks.device

    def run_view(self, first_block: int, n: int) -> Any:
        """Contiguous 1-D uint8 view of blocks ``first_block .. first_block+n-1`` (dense only)."""
        if not self.dense:
            raise ConfigError(f"layer {self.name}: blocks are not adjacent")
        if first_block < 0 or first_block + n > self.num_blocks:
            raise ConfigError(f"block range {first_block}+{n} outside 0..{self.num_blocks}")
        return self.blocks[first_block : first_block + n].reshape(-1)

    @classmethod
    def from_tensor(cls, name: str, index: int, t: Any, kernel_blocks_per_block: int = 1
                    ) -> LayerLayout:
        """Describe ``t`` (dim 0 = blocks). Raises ConfigError if a block's bytes
        are not one contiguous range (layouts with heads outside blocks).

        ``kernel_blocks_per_block > 1``: vLLM split each scheduler block into
        that many kernel blocks (dim 0 counts kernel blocks); they are merged
        back so block ids are the scheduler's (needs adjacent kernel blocks)."""
        import torch

        if t.dim() < 2:
            raise ConfigError(f"layer {name}: KV cache tensor must be [num_blocks, ...]")
        es = t.element_size()
        num_blocks = int(t.shape[0])
        # Interior dims sorted innermost first must tile one dense range.
        inner = sorted(
            ((int(t.stride(d)) * es, int(t.shape[d])) for d in range(1, t.dim())),
            key=lambda p: p[0],
        )
        run = es
        for stride, size in inner:
            if size == 1:
                continue
            if stride != run:
                raise ConfigError(
                    f"layer {name}: KV layout shape {tuple(t.shape)} strides {tuple(t.stride())} "
                    "splits a block into pieces; use a block-contiguous KV cache layout "
                    "(e.g. VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC)"
                )
            run *= size
        block_bytes = run
        block_stride = int(t.stride(0)) * es
        r = kernel_blocks_per_block
        if r > 1:
            if block_stride != block_bytes or num_blocks % r:
                raise ConfigError(f"layer {name}: cannot merge {r} kernel blocks per block")
            num_blocks //= r
            block_bytes *= r
            block_stride *= r
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=t.device)
        flat.set_(storage, 0, (storage.nbytes(),), (1,))
        offset = int(t.storage_offset()) * es
        if offset + (num_blocks - 1) * block_stride + block_bytes > storage.nbytes():
            raise ConfigError(f"layer {name}: view exceeds its storage")
        blocks = flat.as_strided((num_blocks, block_bytes), (block_stride, 1), offset)
        return cls(name, index, num_blocks, block_bytes, block_stride, offset, blocks, flat)
