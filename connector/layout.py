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

from kvpool.core.config import ConfigError

__all__ = ["ChunkLayout", "LayerLayout", "consecutive_run"]


def consecutive_run(block_ids: list[int]) -> bool:
    """True when ``block_ids`` are ``b, b+1, ..., b+n-1`` (one contiguous range)."""
    return all(block_ids[i + 1] == block_ids[i] + 1 for i in range(len(block_ids) - 1))


@dataclass
class LayerLayout:
    """One layer's paged KV cache as whole opaque blocks.

    ``blocks`` is a uint8 view ``[num_blocks, block_bytes]`` (strided when
    blocks are not adjacent); ``storage`` is a flat uint8 tensor over the
    whole backing allocation (what :class:`ChunkLayout` indexes when layers share it);
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


class ChunkLayout:
    """Byte layout of one stored chunk: every layer of this worker, layer-major.

    A chunk object is ``[layer][block][block_bytes]``: for each layer (in
    ``layers`` order) the chunk's ``blocks_per_chunk`` blocks back to back.
    :meth:`gather` copies the blocks of many chunks into a contiguous staging
    tensor (one object after another) and :meth:`scatter` copies them back
    into (other) blocks, both with a few device-side kernels per call, never
    one copy per block: when every layer lives in one allocation at offsets
    and strides that are whole blocks (vLLM's layer-outermost and
    block-outermost layouts), the whole request is ONE ``index_select`` /
    ``index_copy_`` over a ``[rows, block_bytes]`` view of that allocation;
    otherwise two kernels per layer.
    """

    def __init__(self, layers: list[LayerLayout], blocks_per_chunk: int) -> None:
        import torch

        if not layers:
            raise ConfigError("no KV layers")
        self.layers = layers
        self.bpc = blocks_per_chunk
        self.device = layers[0].device
        self.object_bytes = blocks_per_chunk * sum(lay.block_bytes for lay in layers)
        bb = layers[0].block_bytes
        # Copy 8-byte words where every block allows it: uint8 index_select is
        # ~40x slower on CPU (and narrower per thread on a GPU).
        self._wide = all(lay.block_bytes % 8 == 0 and lay.offset % 8 == 0
                         and lay.block_stride % 8 == 0 and lay.storage.numel() % 8 == 0
                         for lay in layers)
        self._rows: Any = None  # [rows, bb] view of the one shared allocation
        same = all(lay.storage.data_ptr() == layers[0].storage.data_ptr()
                   and lay.storage.numel() == layers[0].storage.numel() for lay in layers)
        if same and all(lay.block_bytes == bb and lay.offset % bb == 0
                        and lay.block_stride % bb == 0 for lay in layers):
            st = layers[0].storage
            self._rows = self._w(st.as_strided((st.numel() // bb, bb), (bb, 1), 0))
            self._row_off = torch.tensor([lay.offset // bb for lay in layers], dtype=torch.long,
                                         device=self.device).view(1, -1, 1)
            self._row_step = torch.tensor([lay.block_stride // bb for lay in layers],
                                          dtype=torch.long, device=self.device).view(1, -1, 1)
        # column range of each layer inside one object
        self._cols: list[tuple[int, int]] = []
        col = 0
        for lay in layers:
            self._cols.append((col, col + blocks_per_chunk * lay.block_bytes))
            col += blocks_per_chunk * lay.block_bytes

    def _w(self, t: Any) -> Any:
        """``t`` (uint8, last dim contiguous) as 8-byte words when allowed."""
        import torch

        return t.view(torch.int64) if self._wide else t

    @property
    def single_kernel(self) -> bool:
        """True when gather/scatter are one kernel for all layers."""
        return self._rows is not None

    def warm_up(self, scratch: Any) -> None:
        """Run the kernels :meth:`gather` and :meth:`scatter` use once (GPUs load
        them lazily). Reads block 0 of every layer into ``scratch`` (>= one
        object); writes no KV block."""
        import torch

        self.gather([[0] * self.bpc], scratch)
        src = self._w(scratch[: self.object_bytes]).view(self.bpc, -1)
        dst = torch.empty_like(src)
        idx = torch.arange(src.shape[0], device=self.device)
        dst.index_copy_(0, idx, src.index_select(0, idx))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _ids(self, block_ids: list[list[int]]) -> Any:
        import torch

        for ids in block_ids:
            if len(ids) != self.bpc:
                raise ConfigError(f"chunk has {len(ids)} blocks, expected {self.bpc}")
        nb = self.layers[0].num_blocks
        if any(not 0 <= b < nb for ids in block_ids for b in ids):
            raise ConfigError(f"block id outside 0..{nb - 1}")
        return torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def gather(self, block_ids: list[list[int]], out: Any) -> None:
        """Copy chunk ``c``'s blocks (``block_ids[c]``) into object ``c`` of ``out``
        (uint8, >= ``len(block_ids) * object_bytes``, contiguous). Asynchronous
        on the current stream for CUDA tensors."""
        import torch

        n = len(block_ids)
        if n == 0:
            return
        idx = self._ids(block_ids)  # [n, bpc]
        objs = self._w(out[: n * self.object_bytes].view(n, self.object_bytes))
        if self._rows is not None:
            rows = (self._row_off + idx.view(n, 1, self.bpc) * self._row_step).reshape(-1)
            torch.index_select(self._rows, 0, rows, out=objs.view(-1, self._rows.shape[1]))
            return
        flat = idx.reshape(-1)
        k = 8 if self._wide else 1
        for lay, (a, b) in zip(self.layers, self._cols, strict=True):
            objs[:, a // k : b // k].copy_(
                self._w(lay.blocks).index_select(0, flat).view(n, (b - a) // k))

    def scatter(self, block_ids: list[list[int]], src: Any,
                ranges: list[tuple[int, int]] | None = None) -> None:
        """Copy object ``c`` of ``src`` into blocks ``block_ids[c]``; with ``ranges``
        only blocks ``ranges[c][0] <= j < ranges[c][1]`` of chunk ``c`` are written."""
        import torch

        n = len(block_ids)
        if n == 0:
            return
        idx = self._ids(block_ids)  # [n, bpc]
        objs = self._w(src[: n * self.object_bytes].view(n, self.object_bytes))
        k = 8 if self._wide else 1
        sel: Any = None  # positions (chunk * bpc + j) to write, None = all
        if ranges is not None and any(r != (0, self.bpc) for r in ranges):
            pos = [c * self.bpc + j for c, (a, b) in enumerate(ranges) for j in range(a, b)]
            if not pos:
                return
            sel = torch.tensor(pos, dtype=torch.long).to(self.device, non_blocking=True)
        if self._rows is not None:
            L = len(self.layers)
            rows = (self._row_off + idx.view(n, 1, self.bpc) * self._row_step).reshape(-1)
            data = objs.view(-1, self._rows.shape[1])
            if sel is not None:  # same positions in every layer
                lsel = (sel.view(1, -1) // self.bpc * (L * self.bpc)
                        + torch.arange(L, device=self.device).view(-1, 1) * self.bpc
                        + sel.view(1, -1) % self.bpc).reshape(-1)
                rows, data = rows.index_select(0, lsel), data.index_select(0, lsel)
            self._rows.index_copy_(0, rows, data)
            return
        flat = idx.reshape(-1)
        if sel is not None:
            flat = flat.index_select(0, sel)
        for lay, (a, b) in zip(self.layers, self._cols, strict=True):
            part = objs[:, a // k : b // k].reshape(n * self.bpc, lay.block_bytes // k)
            if sel is not None:
                part = part.index_select(0, sel)
            self._w(lay.blocks).index_copy_(0, flat, part)
