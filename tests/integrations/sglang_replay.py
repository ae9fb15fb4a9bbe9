"""SGLang's side of the HiCache storage calls, replayed (pinned to SGLang 0.5.23).

SGLang is too heavy for this suite's venv (torch, triton, transformers...), so
its calls into a storage backend are replayed from its source, PyPI release
0.5.23 (``python/sglang/srt``):

- host pools (``mem_cache/pool_host/mha.py``, ``mla.py``): CPU tensors of
  the same shapes per layout, and the storage-facing methods with the same
  address arithmetic (``get_page_buffer_meta``, ``get_data_page``,
  ``get_dummy_flat_data_page``, ``set_from_flat_data_page``,
  ``get_hybrid_pool_buffer``);
- the cache controller (``managers/cache_controller.py``): how the backend
  is made (``StorageBackendFactory.create_backend`` -> the ``dynamic``
  backend's ``cls(storage_config, kwargs)``), the registration that follows,
  ``_page_backup`` (``batch_set_v1`` per 128 pages, skipped on MLA
  non-writers), ``_storage_hit_query`` (``batch_exists`` per 128 pages,
  stopping at the first short batch) and ``_page_transfer`` (``batch_get_v1``
  per batch, leading successes counted), and the copying forms
  ``_generic_page_set``/``_generic_page_get``.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.integrations.sglang import HiCacheStorageConfig, HiCacheStorageExtraInfo

STORAGE_BATCH_SIZE = 128  # hicache_storage.py: max pages per batched storage call


def page_hashes(tokens: list[int], page_size: int, last_hash: str | None = None) -> list[str]:
    """A chained hash per full page (the shape of SGLang's get_storage_hash_str)."""
    out = []
    prev = last_hash or ""
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prev = hashlib.sha256((prev + repr(tokens[i:i + page_size])).encode()).hexdigest()
        out.append(prev)
    return out


class MHAHostPool:
    """MHATokenToKVPoolHost's storage-facing part (layer_first / page_first)."""

    def __init__(self, layer_num: int = 3, head_num: int = 2, head_dim: int = 8,
                 pages: int = 16, page_size: int = 4, layout: str = "page_first",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        self.size = pages * page_size
        if layout == "layer_first":
            dims = (2, layer_num, self.size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, self.size, layer_num, head_num, head_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.k_buffer, self.v_buffer]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        token = self.head_num * self.head_dim * item
        v_offset = self.layer_num * self.size * token
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = base + idx[i] * token + layer * self.size * token
                    ptrs += [k, k + v_offset]
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * token
                ptrs += [k, k + v_offset]
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size, :, :]
        else:
            page = self.kv_buffer[:, index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def page(self, index: int) -> torch.Tensor:
        """A copy of the page at token slot ``index`` (for comparisons)."""
        return self.get_data_page(index).clone()


class MLAHostPool:
    """MLATokenToKVPoolHost's storage-facing part (no DCP)."""

    def __init__(self, layer_num: int = 3, kv_cache_dim: int = 24, pages: int = 16,
                 page_size: int = 4, layout: str = "page_first",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layer_num, self.kv_cache_dim = layer_num, kv_cache_dim
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        self.size = pages * page_size
        dims = (layer_num, self.size, 1, kv_cache_dim) if layout == "layer_first" \
            else (self.size, layer_num, 1, kv_cache_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        starts = indices.tolist()[::self.page_size]
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for index in starts:
                for layer in range(self.layer_num):
                    ptrs.append(base + index * self.kv_cache_dim * item
                                + layer * self.size * self.kv_cache_dim * item)
            size = item * self.page_size * self.kv_cache_dim
        else:
            for index in starts:
                ptrs.append(base + index * self.layer_num * self.kv_cache_dim * item)
            size = self.layer_num * item * self.page_size * self.kv_cache_dim
        return ptrs, [size] * len(ptrs)

    def page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, index:index + self.page_size].flatten().clone()
        return self.kv_buffer[index:index + self.page_size].flatten().clone()


class MambaHostPool:
    """A Mamba state pool's storage-facing part (pool_host/mamba.py, page_first):
    one slot a page; per slot a temporal state and conv states, each its own buffer."""

    def __init__(self, slots: int = 8, layers: int = 2, temporal: int = 16,
                 conv: tuple[int, ...] = (8, 4)) -> None:
        self.page_size, self.layout = 1, "page_first"
        self.temporal_buffer = torch.zeros((slots, layers, temporal), dtype=torch.float32)
        self.conv_buffer = [torch.zeros((slots, layers, c), dtype=torch.bfloat16) for c in conv]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.temporal_buffer, *self.conv_buffer]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs: list[int] = []
        sizes: list[int] = []
        for i in indices.tolist():
            for buf in (self.temporal_buffer, *self.conv_buffer):
                row = buf[0].numel() * buf.element_size()
                ptrs.append(buf.data_ptr() + i * row)
                sizes.append(row)
        return ptrs, sizes

    def slot(self, i: int) -> list[torch.Tensor]:
        return [b[i].clone() for b in (self.temporal_buffer, *self.conv_buffer)]

    def fill(self, i: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for b in (self.temporal_buffer, *self.conv_buffer):
            b[i] = torch.randn(b[i].shape, generator=g).to(b.dtype)


def fill_pages(pool: Any, indices: torch.Tensor, seed: int) -> None:
    """Random bytes in the token slots ``indices`` of a KV host pool."""
    g = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    if isinstance(pool, MHAHostPool):
        sel = (slice(None), slice(None), indices) if pool.layout == "layer_first" \
            else (slice(None), indices)
    else:
        sel = (slice(None), indices) if pool.layout == "layer_first" else (indices,)
    shape = buf[sel].shape
    buf[sel] = torch.randn(shape, generator=g).to(buf.dtype)


def storage_config(tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   layout: str = "page_first", model: str = "org/model",
                   extra: dict[str, Any] | None = None) -> Any:
    """The HiCacheStorageConfig CacheController._generate_storage_config builds."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name=model,
        extra_config=dict(extra or {}))


def load_dynamic_backend(cfg: Any, host_pool: Any) -> Any:
    """StorageBackendFactory._create_dynamic_backend, then attach_storage_backend's
    registration: import ``module_path``, take ``class_name``, call it with
    ``(storage_config, kwargs)`` (``kwargs`` is ``{}``: the controller passes
    none), ``register_mem_pool_host``, ``on_host_pools_registered``."""
    extra = cfg.extra_config
    for f in ("backend_name", "module_path", "class_name"):
        assert f in extra, f
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    backend = cls(cfg, {})
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


@dataclass
class Controller:
    """One rank's HiCacheController, reduced to its storage calls."""

    backend: Any
    pool: Any
    cfg: Any
    page_size: int = 4
    calls: list[str] = field(default_factory=list)

    @property
    def zero_copy(self) -> bool:
        return bool(self.cfg.extra_config.get("interface_v1", 0))

    def _indices(self, pages: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size)
                          for p in pages]).to(torch.int64)

    def backup(self, hashes: list[str], pages: list[int],
               prefix_keys: list[str] | None = None) -> int:
        """_page_backup: per batch ``batch_set_v1`` (or ``batch_set`` of data
        pages); stops at the first failed batch; skipped on MLA non-writers.
        Returns the tokens backed up."""
        if not self.cfg.is_storage_writer:
            return 0
        host = self._indices(pages)
        done = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host[i * self.page_size:(i + len(batch)) * self.page_size]
            info = HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
            if self.zero_copy:
                self.calls.append("batch_set_v1")
                ok = all(self.backend.batch_set_v1(batch, idx, info))
            else:  # _generic_page_set
                self.calls.append("batch_set")
                data = [self.pool.get_data_page(int(idx[j * self.page_size]))
                        for j in range(len(batch))]
                ok = self.backend.batch_set(batch, data)
            if not ok:
                break
            if prefix_keys is not None:
                prefix_keys = prefix_keys + batch
            done += self.page_size * len(batch)
        return done

    def hit_query(self, hashes: list[str], prefix_keys: list[str] | None = None) -> list[str]:
        """_storage_hit_query: the leading hashes the storage holds."""
        hit: list[str] = []
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            self.calls.append("batch_exists")
            n = self.backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=prefix_keys))
            hit += batch[:n]
            if n < len(batch):
                break
            if prefix_keys is not None:
                prefix_keys = prefix_keys + batch
        return hit

    def transfer(self, hashes: list[str], pages: list[int]) -> int:
        """_page_transfer: ``batch_get_v1`` (or ``batch_get`` into dummy pages
        then ``set_from_flat_data_page``) per batch; the pages read, leading only."""
        host = self._indices(pages)
        done = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host[i * self.page_size:(i + len(batch)) * self.page_size]
            if self.zero_copy:
                self.calls.append("batch_get_v1")
                res = self.backend.batch_get_v1(batch, idx, HiCacheStorageExtraInfo())
                n = res.index(False) if False in res else len(res)
            else:  # _generic_page_get
                self.calls.append("batch_get")
                dummies = [self.pool.get_dummy_flat_data_page() for _ in batch]
                got = self.backend.batch_get(batch, dummies)
                n = 0
                for j, page in enumerate(got):
                    if page is None:
                        break
                    self.pool.set_from_flat_data_page(int(idx[j * self.page_size]), page)
                    n += 1
            done += n
            if n < len(batch):
                break
        return done


def real_sglang_pool(kind: str, layout: str, tokens: int = 32) -> Any:
    """SGLang's own host pool (MHATokenToKVPoolHost / MLATokenToKVPoolHost) on
    CPU, of the replicas' default geometry; needs SGLang importable."""
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    layers, page, dtype, cpu = 3, 4, torch.bfloat16, torch.device("cpu")
    geometry = {"device_capacity_tokens": tokens, "start_layer": 0, "end_layer": layers}
    if kind == "mha":
        k = tuple(torch.zeros(tokens, 2, 8, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(tokens, 2, 8, dtype=dtype) for _ in range(layers))
        bufs = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                         v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                         layout=KVBufferLayout.NHD)
        info = MHABufferInfo(buffers=bufs, page_size=page, head_num=2, head_dim=8,
                             v_head_dim=8, dtype=dtype, device=cpu)
        return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False,
                                    device="cpu", **geometry)
    rows = tuple(torch.zeros(tokens, 1, 24, dtype=dtype) for _ in range(layers))
    mla = MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([t.data_ptr() for t in rows]),
                        layer_indices=tuple(range(layers)), device_layer_num=layers,
                        page_size=page, kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=24,
                        dtype=dtype, device=cpu)
    return MLATokenToKVPoolHost(mla, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                target_layer_num=layers, **geometry)


def real_sglang_mamba_pool(slots: int = 8) -> Any:
    """SGLang's own MambaPoolHost (page_first) on CPU; needs SGLang importable."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, slots, 3, 16, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                         layout="page_first")
