"""Byte-level views of vLLM's paged KV cache and the byte layout of stored objects.

vLLM 0.31-0.33 hand the connector one tensor per layer, a ``[num_blocks,
kv_heads, block_size, 2*head_size]`` view whose physical order depends on
the backend: heads outside tokens (``HNC``: CPU) or tokens outside heads
(``NHC``: CUDA's default), layers outermost or blocks outermost. MLA caches
are ``[num_blocks, block_size, latent]`` (one "head"). A block of a layer is
``block_bytes`` at ``base + b * block_stride`` of the layer's storage;
inside it, head ``h`` is ``tokens`` rows of ``row_bytes`` (HNC: one row, the
head's whole slab; NHC: one row per token, ``token_stride`` apart).

A stored object holds one chunk for a range of layers (a layer group) and a
range of KV heads, head-major: ``[head][layer][block][token][2*head_size]``.
That order is the same for HNC and NHC caches and for any tensor-parallel
split: the object of heads ``[0, 8)`` is the objects of ``[0, 4)`` and
``[4, 8)`` back to back, so engines with different TP sizes share objects
(:class:`ObjectLayout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvpool.core.config import ConfigError

__all__ = ["LayerLayout", "ObjectLayout", "consecutive_run"]

# The widest word copies move rows in (16: complex128, 8: int64, 1: uint8);
# a comparison knob for the GPU check, not a setting.
WIDEST_WORD = 16


def consecutive_run(block_ids: list[int]) -> bool:
    """True when ``block_ids`` are ``b, b+1, ..., b+n-1`` (one contiguous range)."""
    return all(block_ids[i + 1] == block_ids[i] + 1 for i in range(len(block_ids) - 1))


@dataclass
class LayerLayout:
    """One layer's paged KV cache: whole blocks and the heads inside them.

    ``blocks`` is a uint8 view ``[num_blocks, block_bytes]`` (strided when
    blocks are not adjacent); ``storage`` a flat uint8 tensor over the whole
    backing allocation; ``dense``: block ``b + 1`` starts right after ``b``.
    Head ``h`` of a block is ``tokens`` rows of ``row_bytes``, the first at
    ``h * head_stride`` and each next one ``token_stride`` further.
    """

    name: str
    index: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    offset: int
    blocks: Any
    storage: Any
    heads: int = 1
    head_stride: int = 0
    tokens: int = 1
    token_stride: int = 0
    row_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.row_bytes:
            self.row_bytes = self.block_bytes

    @property
    def dense(self) -> bool:
        return self.block_stride == self.block_bytes

    @property
    def device(self) -> Any:
        return self.blocks.device

    @property
    def unit_bytes(self) -> int:
        """Bytes of one head of one block."""
        return self.tokens * self.row_bytes

    @classmethod
    def from_tensor(cls, name: str, index: int, t: Any, kernel_blocks_per_block: int = 1,
                    heads: int | None = None) -> LayerLayout:
        """Describe ``t`` (dim 0 = blocks). Raises ConfigError if a block's bytes
        are not one contiguous range (layouts with heads outside blocks).

        ``kernel_blocks_per_block > 1``: vLLM split each scheduler block into
        that many kernel blocks (dim 0 counts kernel blocks); they are merged
        back so block ids are the scheduler's (needs adjacent kernel blocks).
        ``heads``: KV heads of this worker; a 4-D ``[blocks, heads, tokens,
        2*head_size]`` view with that many heads is described head by head,
        anything else (MLA) as one opaque "head" per block."""
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
        n_heads, head_stride, tokens, token_stride, row_bytes = 1, 0, 1, 0, block_bytes
        if (heads is not None and heads > 1 and t.dim() == 4 and int(t.shape[1]) == heads
                and int(t.stride(3)) == 1):
            x = int(t.shape[3]) * es  # one token of one head
            n = int(t.shape[2])
            s_h, s_n = int(t.stride(1)) * es, int(t.stride(2)) * es
            if s_n == x:  # HNC: a head's tokens are one slab
                n_heads, head_stride, tokens, token_stride, row_bytes = heads, s_h, 1, 0, n * x
            elif s_h == x:  # NHC: a token's heads are adjacent
                n_heads, head_stride, tokens, token_stride, row_bytes = heads, x, n, s_n, x
        r = kernel_blocks_per_block
        if r > 1:
            if block_stride != block_bytes or num_blocks % r:
                raise ConfigError(f"layer {name}: cannot merge {r} kernel blocks per block")
            if n_heads > 1 and tokens == 1:  # HNC: one slab per kernel block
                tokens, token_stride = r, block_bytes
            elif n_heads > 1:  # NHC: rows stay evenly spaced across kernel blocks
                tokens *= r
            num_blocks //= r
            block_bytes *= r
            block_stride *= r
            if n_heads == 1:
                row_bytes = block_bytes
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=t.device)
        flat.set_(storage, 0, (storage.nbytes(),), (1,))
        offset = int(t.storage_offset()) * es
        if offset + (num_blocks - 1) * block_stride + block_bytes > storage.nbytes():
            raise ConfigError(f"layer {name}: view exceeds its storage")
        blocks = flat.as_strided((num_blocks, block_bytes), (block_stride, 1), offset)
        return cls(name, index, num_blocks, block_bytes, block_stride, offset, blocks, flat,
                   n_heads, head_stride, tokens, token_stride, row_bytes)


class ObjectLayout:
    """Moves stored objects between staging tensors and the paged KV cache.

    An object is one chunk (``blocks_per_chunk`` blocks) of a range of layers
    (indices into ``layers``) and a range ``[h0, h1)`` of this worker's heads,
    ordered ``[head][layer][block][row]`` (see the module docstring).
    :meth:`gather` copies the objects of many chunks into a contiguous tensor
    and :meth:`scatter` copies them back into (other) blocks: when every layer
    lives in one allocation at offsets and strides that are whole rows
    (vLLM's layer-outermost and block-outermost layouts), ONE ``index_select``
    / ``index_copy_`` over a ``[rows, row_bytes]`` view of it; otherwise one
    per layer. Never one copy per block.
    """

    def __init__(self, layers: list[LayerLayout], blocks_per_chunk: int) -> None:
        import torch

        if not layers:
            raise ConfigError("no KV layers")
        first = layers[0]
        for lay in layers:
            if (lay.heads, lay.tokens, lay.row_bytes) != (first.heads, first.tokens,
                                                          first.row_bytes):
                raise ConfigError("KV layers differ in heads or block geometry")
        self.layers = layers
        self.bpc = blocks_per_chunk
        self.heads = first.heads
        self.device = first.device
        self.rb = first.row_bytes
        rb = self.rb
        # copies move rows as the widest words every offset allows (16-byte
        # words copy ~2x faster than 8-byte ones on a GPU; bytes stay bytes)
        self._word = next(w for w in (16, 8, 1) if w <= WIDEST_WORD and rb % w == 0 and all(
            lay.offset % w == 0 and lay.block_stride % w == 0 and lay.head_stride % w == 0
            and lay.token_stride % w == 0 and lay.storage.numel() % w == 0 for lay in layers))
        same = all(lay.storage.data_ptr() == first.storage.data_ptr()
                   and lay.storage.numel() == first.storage.numel() for lay in layers)
        self._shared = same and all(
            lay.offset % rb == 0 and lay.block_stride % rb == 0 and lay.head_stride % rb == 0
            and lay.token_stride % rb == 0 for lay in layers)
        if not self._shared and not all(
                lay.offset % rb == 0 and lay.block_stride % rb == 0
                and lay.head_stride % rb == 0 and lay.token_stride % rb == 0 for lay in layers):
            raise ConfigError("KV layer offsets are not whole rows")
        # per word size: the whole allocation as rows (shared) or each layer's
        self._row_views: dict[int, list[Any]] = {}
        dev = self.device
        L = len(layers)
        # per layer, in rows: base offset, block step, head step; token step (all layers)
        self._off = torch.tensor([lay.offset // rb for lay in layers], device=dev)
        self._bstep = torch.tensor([lay.block_stride // rb for lay in layers], device=dev)
        self._hstep = torch.tensor([lay.head_stride // rb for lay in layers], device=dev)
        self._tstep = torch.tensor([lay.token_stride // rb for lay in layers], device=dev)
        self._tok = torch.arange(first.tokens, device=dev)
        self._L = L
        # the same steps as host ints: a scatter into one run of consecutive
        # blocks can then be one strided copy instead of an indexed one
        self._steps = [(lay.offset // rb, lay.block_stride // rb, lay.head_stride // rb,
                        lay.token_stride // rb) for lay in layers]
        # per (layer selection, head range): the rows of block 0 and the block
        # step, on the device, made once (building them per call costs kernels,
        # and torch.tensor(..., device=cuda) syncs the host with the stream, i.e.
        # waits for the forward's queued kernels in the middle of a layer-wise load)
        self._bases: dict[tuple[tuple[int, ...], int, int], tuple[Any, Any]] = {}
        # the last block ids moved to the device (a load's layer groups share
        # them) and the rows made for them per (layer selection, head range)
        self._last_ids: tuple[tuple[int, tuple[int, ...]], Any, dict[Any, Any]] | None = None

    def _w(self, t: Any, word: int) -> Any:
        """``t`` (uint8, last dim contiguous) as ``word``-byte words."""
        import torch

        if word == 1:
            return t
        return t.view(torch.complex128 if word == 16 else torch.int64)

    def _word_for(self, buf: Any) -> int:
        """The widest word both the KV rows and ``buf`` (a staging tensor) allow."""
        w = self._word
        while w > 1 and buf.data_ptr() % w:
            w //= 2 if w == 16 else 8
        return w

    def _rows_as(self, word: int) -> list[Any]:
        """``[rows, row words]`` views: one over the shared allocation, or one per layer."""
        views = self._row_views.get(word)
        if views is None:
            rb = self.rb
            sts = [self.layers[0].storage] if self._shared else [lay.storage for lay in self.layers]
            views = self._row_views[word] = [
                self._w(st.as_strided((st.numel() // rb, rb), (rb, 1), 0), word) for st in sts]
        return views

    @property
    def single_kernel(self) -> bool:
        """True when gather/scatter are one kernel for all layers."""
        return self._shared

    def object_bytes(self, layer_sel: Sequence[int], heads: int) -> int:
        """Bytes of one chunk's object over ``layer_sel`` and ``heads`` heads."""
        return heads * len(layer_sel) * self.bpc * self.layers[0].unit_bytes

    def _index(self, block_ids: list[list[int]], layer_sel: Sequence[int], h0: int,
               h1: int) -> Any:
        """Row numbers ``[chunks, heads, layers, blocks, tokens]`` (object order)."""
        import torch

        for chunk in block_ids:
            if len(chunk) != self.bpc:
                raise ConfigError(f"chunk has {len(chunk)} blocks, expected {self.bpc}")
        if not 0 <= h0 < h1 <= self.heads:
            raise ConfigError(f"head range {h0}:{h1} outside 0..{self.heads}")
        dev = self.device
        # a block id < 0 (a block the caller does not write) reads as block 0
        ids = tuple(x if x >= 0 else 0 for chunk in block_ids for x in chunk)
        key = (tuple(layer_sel), h0, h1)
        # tensors made on one CUDA stream are reused on that stream only (the
        # save thread, the load's scatters and the forward use their own)
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        last = self._last_ids  # one read: async loads scatter from another thread
        if last is not None and last[0] == (stream, ids):
            b, made = last[1], last[2]  # the next layer group of the same chunks
            rows = made.get(key)
            if rows is not None:
                return rows
        else:
            b = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
            made = {}
            self._last_ids = ((stream, ids), b, made)
        found = self._bases.get(key)
        if found is None:
            found = self._make_base(layer_sel, h0, h1)
            if dev.type == "cuda":  # complete before another stream uses it (rare)
                torch.cuda.current_stream(dev).synchronize()
        base, bstep = found
        # rows of chunk c, block j: base + block id * block step (two kernels)
        rows = made[key] = base + b.view(len(block_ids), 1, 1, self.bpc, 1) * bstep
        return rows

    def _make_base(self, layer_sel: Sequence[int], h0: int, h1: int) -> tuple[Any, Any]:
        """Rows of block 0 of objects over ``layer_sel`` and heads ``[h0, h1)``
        (``[1, heads, layers, 1, tokens]``) and the block step, cached."""
        import torch

        dev = self.device
        sel = torch.tensor(list(layer_sel), dtype=torch.long, device=dev)
        nl = len(layer_sel)
        h = torch.arange(h0, h1, device=dev)
        base = (self._off[sel].view(1, 1, nl, 1, 1)
                + h.view(1, -1, 1, 1, 1) * self._hstep[sel].view(1, 1, nl, 1, 1)
                + self._tok.view(1, 1, 1, 1, -1) * self._tstep[sel].view(1, 1, nl, 1, 1))
        found = self._bases[(tuple(layer_sel), h0, h1)] = (base,
                                                           self._bstep[sel].view(1, 1, nl, 1, 1))
        return found

    def prepare_bases(self, layer_sels: Sequence[Sequence[int]], h0: int, h1: int) -> None:
        """Make the cached rows of block 0 for each of ``layer_sels`` now and
        wait for them (at registration: a base made later is waited for on
        its stream, in the middle of a load or save)."""
        import torch

        for sel in layer_sels:
            if (tuple(sel), h0, h1) not in self._bases:
                self._make_base(sel, h0, h1)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _run_view(self, block_ids: list[list[int]], layer_sel: Sequence[int], h0: int,
                  h1: int, word: int = 1) -> Any:
        """The blocks of chunks ``block_ids`` (layers ``layer_sel``, heads ``[h0,
        h1)``) as ONE strided view ``[chunks, heads, layers, blocks, tokens,
        row]`` in object order, when the chunks' blocks are one run of
        consecutive ids and the layers are consecutive, evenly spaced and alike
        (vLLM's single allocation; a fresh request's blocks): an elementwise
        copy to or from it moves the rows several times faster than an indexed
        one. None when not applicable."""
        if not self._shared or not 0 <= h0 < h1 <= self.heads or \
                any(len(chunk) != self.bpc for chunk in block_ids):
            return None  # the indexed path checks (and refuses) what is odd
        ids = [x for chunk in block_ids for x in chunk]
        b0 = ids[0]
        if ids != list(range(b0, b0 + len(ids))):
            return None
        sel = list(layer_sel)
        steps = [self._steps[li] for li in sel]
        off0, bstep, hstep, tstep = steps[0]
        lstep = steps[1][0] - off0 if len(sel) > 1 else 0
        if (len(sel) > 1 and lstep <= 0) or sel != list(range(sel[0], sel[0] + len(sel))) or any(
                st != (off0 + j * lstep, bstep, hstep, tstep) for j, st in enumerate(steps)):
            return None
        rows = self._rows_as(word)[0]
        w = rows.shape[1]  # elements per row
        return rows.as_strided(
            (len(block_ids), h1 - h0, len(sel), self.bpc, self.layers[0].tokens, w),
            (self.bpc * bstep * w, hstep * w, lstep * w, bstep * w, tstep * w, 1),
            rows.storage_offset() + (off0 + b0 * bstep + h0 * hstep) * w)

    def prepared_scatter(self, block_ids: list[list[int]], layer_sel: Sequence[int], h0: int,
                         h1: int, src: Any) -> Callable[[], None] | None:
        """The copy :meth:`scatter` of whole chunks would launch, made now with its
        checks and views, when it is one strided copy (the chunks' blocks are
        one run); None otherwise. Calling the result launches the copy on the
        current stream: a layer-wise load makes it for its first group before
        the data arrives, so the scatter that the first layer waits for is one
        call."""
        if not block_ids:
            return None
        nb = self.layers[0].num_blocks
        if any(len(ids) != self.bpc or min(ids) < 0 or max(ids) >= nb for ids in block_ids):
            return None  # scatter() says what is wrong
        if src.numel() < len(block_ids) * self.object_bytes(layer_sel, h1 - h0):
            return None
        pair = self._run_pair(block_ids, layer_sel, h0, h1, src)
        return None if pair is None else partial(pair[0].copy_, pair[1])

    def _run_pair(self, block_ids: list[list[int]], layer_sel: Sequence[int], h0: int, h1: int,
                  buf: Any) -> tuple[Any, Any] | None:
        """(the blocks' :meth:`_run_view`, ``buf``'s objects viewed alike) in the
        widest word both allow, or None when the blocks are not one run."""
        word = self._word_for(buf)
        run = self._run_view(block_ids, layer_sel, h0, h1, word)
        if run is None:
            return None
        n = len(block_ids) * self.object_bytes(layer_sel, h1 - h0)
        return run, self._w(buf[:n], word).view(run.shape)

    def prepare_scatter(self, block_ids: list[list[int]], layer_sels: Sequence[Sequence[int]],
                        h0: int, h1: int) -> None:
        """Make the rows :meth:`scatter` of chunks ``block_ids`` writes for each
        of ``layer_sels`` now (queued on the device, no host sync), ahead of the
        data: a layer-wise load does this before its first group arrives, so a
        scatter right after an arrival only launches its copy (none needed for
        a run of consecutive blocks: one strided copy)."""
        for sel in layer_sels:
            if self._run_view(block_ids, sel, h0, h1, self._word) is None:
                self._index(block_ids, sel, h0, h1)

    def warm_up(self, scratch: Any) -> None:
        """Run the kernels :meth:`gather` and :meth:`scatter` use once (GPUs load
        them lazily). Reads block 0 of every layer into ``scratch`` (>= one
        object of every layer and head); writes no KV block."""
        import torch

        every = range(self._L)
        self.gather([[0] * self.bpc], every, 0, self.heads, scratch)
        n = self.object_bytes(every, self.heads)
        word = self._word_for(scratch)
        src = self._w(scratch[:n], word).view(-1, self.rb // word)
        idx = torch.arange(src.shape[0], device=self.device)
        torch.empty_like(src).index_copy_(0, idx, src.index_select(0, idx))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def gather(self, block_ids: list[list[int]], layer_sel: Sequence[int], h0: int, h1: int,
               out: Any) -> None:
        """Copy the objects of chunks ``block_ids`` (layers ``layer_sel``, heads
        ``[h0, h1)``) into ``out`` (uint8, contiguous, one object after another).
        Asynchronous on the current stream for CUDA tensors."""
        if not block_ids:
            return
        nb = self.layers[0].num_blocks
        if any(not 0 <= x < nb for ids in block_ids for x in ids):
            raise ConfigError(f"block id outside 0..{nb - 1}")
        pair = self._run_pair(block_ids, layer_sel, h0, h1, out)
        if pair is not None:
            pair[1].copy_(pair[0])
            return
        n = len(block_ids) * self.object_bytes(layer_sel, h1 - h0)
        word = self._word_for(out)
        rows = self._index(block_ids, layer_sel, h0, h1)
        dst = self._w(out[:n], word).view(*rows.shape, -1)
        views = self._rows_as(word)
        if self._shared:
            import torch

            torch.index_select(views[0], 0, rows.reshape(-1),
                               out=dst.view(-1, dst.shape[-1]))
            return
        for j, li in enumerate(layer_sel):
            dst[:, :, j].copy_(views[li].index_select(
                0, rows[:, :, j].reshape(-1)).view(dst[:, :, j].shape))

    def scatter(self, block_ids: list[list[int]], layer_sel: Sequence[int], h0: int, h1: int,
                src: Any, ranges: list[tuple[int, int]] | None = None) -> None:
        """Copy objects from ``src`` (as :meth:`gather` writes them) into blocks
        ``block_ids``; with ``ranges`` only blocks ``ranges[c][0] <= j <
        ranges[c][1]`` of chunk ``c`` are written (others may be -1)."""
        import torch

        if not block_ids:
            return
        C = len(block_ids)
        nb = self.layers[0].num_blocks
        for c, ids in enumerate(block_ids):
            a, b = ranges[c] if ranges is not None else (0, self.bpc)
            if a < b and (min(ids[a:b]) < 0 or max(ids[a:b]) >= nb):
                raise ConfigError(f"block id outside 0..{nb - 1}")
        n = C * self.object_bytes(layer_sel, h1 - h0)
        whole = ranges is None or all(r == (0, self.bpc) for r in ranges)
        pair = self._run_pair(block_ids, layer_sel, h0, h1, src) if whole else None
        if pair is not None:
            pair[0].copy_(pair[1])
            return
        word = self._word_for(src)
        rows = self._index(block_ids, layer_sel, h0, h1)
        data = self._w(src[:n], word).view(*rows.shape, -1)
        views = self._rows_as(word)
        mask = None
        if not whole:
            assert ranges is not None
            m = torch.zeros(C, self.bpc, dtype=torch.bool)
            for c, (a, b) in enumerate(ranges):
                m[c, a:b] = True
            mask = m.to(self.device).view(C, 1, 1, self.bpc, 1).expand(rows.shape)
        if self._shared:
            if mask is None:
                views[0].index_copy_(0, rows.reshape(-1), data.reshape(-1, data.shape[-1]))
            else:
                views[0].index_copy_(0, rows[mask], data[mask])
            return
        for j, li in enumerate(layer_sel):
            r, d = rows[:, :, j], data[:, :, j]
            if mask is None:
                views[li].index_copy_(0, r.reshape(-1), d.reshape(-1, d.shape[-1]))
            else:
                mj = mask[:, :, j]
                views[li].index_copy_(0, r[mj], d[mj])
