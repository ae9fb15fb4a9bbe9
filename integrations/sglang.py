"""kvpool as an SGLang HiCache storage backend (the L3 tier under HiRadixCache).

SGLang loads it through its ``dynamic`` backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang",
        "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
        "master_address": "10.0.0.1:50051"}'

(docs/sglang.md lists every key.) SGLang builds the class as
``cls(storage_config, kwargs)`` and then calls ``register_mem_pool_host``
with its host KV pool (torch CPU tensors); ``interface_v1: 1`` selects the
zero-copy calls (``batch_get_v1``/``batch_set_v1``), which move each page
straight between the host pool and the pool's segments: the page's buffers
(``get_page_buffer_meta``: K and V for MHA page-first, one per layer and
component for layer-first) are the parts of one object, written by one
``batch_put_parts`` and read by one ``batch_get_parts`` per call. Without
it SGLang copies pages through ``batch_get``/``batch_set`` (flat pages).

Keys: ``<key_prefix>/<model>/<format>/<shard>/<pool>/<page hash>``. The
format is the host layout and KV dtype for zero-copy objects
(``page_first-bfloat16``; ``page_first``, ``page_first_direct`` and
``layer_first`` each order a page's bytes their own way) and
``flat-<layout>-<dtype>`` for the copying calls' flat pages, so engines of
another layout, dtype or interface miss rather than read garbled pages.
The shard is ``tp<r>of<n>`` for MHA, so each TP rank stores its heads, and
``mla`` for MLA (one copy: only the storage writer, rank 0, writes; every
rank reads the same object); pipeline and context parallelism add their
rank. Two engines of the same model, format and parallelism share every
page, as SGLang's page hashes chain from the sequence start.

Hybrid models (``register_mem_host_pool_v2``, ``batch_*_v2`` with
``PoolTransfer``) store each side pool's page (Mamba state, SWA, indexer...)
as an object of its own under its pool name; Mamba state is TP-sharded even
for MLA, so every rank writes its own.

A missing page is a miss (False, None, a shorter prefix), never an error;
a store that cannot be reached makes a call answer "nothing" (logged), as
SGLang treats every storage failure as a miss.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store.client import Client
from kvpool.store.config import client_config_from_env

try:  # SGLang's own classes inside an engine, so its factory's issubclass check passes
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    SGLANG_IMPORTED = True
except ImportError:  # no SGLang here: the same contract, pinned (see _sglang_api)
    from kvpool.integrations._sglang_api import (  # type: ignore[assignment]
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    SGLANG_IMPORTED = False

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "SGLANG_IMPORTED",
    "KVPoolHiCacheStorage",
    "page_object_key",
]

log = logging.getLogger(__name__)

#: extra_config keys this backend reads, with what they do (docs/sglang.md)
EXTRA_CONFIG_KEYS: dict[str, str] = {
    "master_address": "the kvpool master HOST:PORT (over the client YAML's)",
    "client_config": "a kvpool client YAML (configs/client.yaml); default $KVPOOL_CONFIG",
    "client_overrides": "a mapping of ClientConfig keys over the YAML, e.g. {memory_size: 4GiB}",
    "tenant": "the kvpool tenant whose keys and quota the engine uses",
    "key_prefix": "first component of every key (default 'sglang'): engines with another "
                  "prefix share nothing",
}
# keys SGLang itself reads from the same mapping: accepted silently
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
})
_STORED = (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS)
_FLAT = "flat"


def _kv(name: Any) -> str:
    """A pool name as a key component (PoolName or str)."""
    return str(getattr(name, "value", name))


def page_object_key(prefix: str, fmt: str, shard: str, pool: str, page_hash: str) -> str:
    """The kvpool key of one page of one pool (module docstring)."""
    return f"{prefix}/{fmt}/{shard}/{pool}/{page_hash}"


class _PoolMemory:
    """The host pool buffers registered with the client, and views of their pages.

    SGLang's host pools describe a page by raw addresses (``get_page_buffer_meta``);
    an address inside a registered buffer becomes a numpy view of it (what the
    transfer engine moves without per-call setup), any other one a raw
    ``(address, length)`` pair. Registrations replace the index as a whole, so
    the I/O threads read it without a lock while a late side pool registers.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._lock = threading.Lock()
        # (sorted starts, start -> (end, handle)), replaced, never changed in place
        self._index: tuple[list[int], dict[int, tuple[int, Any]]] = ([], {})

    def register(self, tensor: Any) -> None:
        if tensor is None:
            return
        start = int(tensor.data_ptr())
        with self._lock:
            regions = self._index[1]
            if start in regions:
                return
            handle = self._client.register_buffer(tensor)
            regions = {**regions, start: (start + int(handle.length), handle)}
            self._index = (sorted(regions), regions)

    def view(self, ptr: int, size: int) -> Any:
        starts, regions = self._index
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0:
            start = starts[i]
            end, handle = regions[start]
            array = getattr(handle, "array", None)
            if ptr + size <= end and array is not None:
                return array[ptr - start:ptr - start + size]
        return (ptr, size)

    def release(self) -> None:
        with self._lock:
            _, regions = self._index
            self._index = ([], {})
        for _, handle in regions.values():
            try:
                self._client.unregister_buffer(handle)
            except KVPoolError as exc:
                log.debug("unregister host pool buffer: %s", exc)


def _page_parts(memory: _PoolMemory, host_pool: Any, host_indices: Any,
                n_pages: int) -> tuple[list[list[Any]], list[int]]:
    """Each page's buffers (in the host pool's order) and its total bytes."""
    ptrs, sizes = host_pool.get_page_buffer_meta(host_indices)
    if n_pages == 0:
        return [], []
    if len(ptrs) == n_pages and ptrs and isinstance(ptrs[0], Sequence):
        groups = [list(zip(p, s, strict=True)) for p, s in zip(ptrs, sizes, strict=True)]
    else:
        if len(ptrs) % n_pages or len(sizes) != len(ptrs):
            raise ConfigError(
                f"host pool {type(host_pool).__name__} gave {len(ptrs)} buffers for "
                f"{n_pages} pages")
        per = len(ptrs) // n_pages
        pairs = list(zip(ptrs, sizes, strict=True))
        groups = [pairs[i * per:(i + 1) * per] for i in range(n_pages)]
    parts = [[memory.view(int(p), int(s)) for p, s in g] for g in groups]
    totals = [sum(int(s) for _, s in g) for g in groups]
    return parts, totals


class _IOStats:
    """Pages and GiB/s per zero-copy call since the last :meth:`take` (SGLang's
    storage metrics: ``prefetch_pgs``, ``backup_pgs`` and their bandwidths)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: dict[str, list[float]] = {}

    def add(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        gibps = nbytes / (1 << 30) / seconds if seconds > 0 else 0.0
        with self._lock:
            self._lists.setdefault(f"{kind}_pgs", []).append(pages)
            self._lists.setdefault(f"{kind}_bandwidth", []).append(gibps)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            lists, self._lists = self._lists, {}
        return lists


class KVPoolHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage on a kvpool cluster (module docstring).

    Thread-safe: SGLang calls it from its prefetch and backup threads at once.
    """

    def __init__(self, storage_config: HiCacheStorageConfig | None = None,
                 kwargs: Any = None, *, client: Client | None = None) -> None:
        """Connect to the pool named by ``storage_config.extra_config``.

        ``kwargs``: what SGLang's factory passes second (a dict for the
        ``dynamic`` backend, the host pool for built-in ones); a host pool is
        registered at once. ``client``: a set-up client to use instead of
        making one (it is not closed by :meth:`close`). Raises ConfigError
        for an extra_config this backend cannot honour (split heads) and the
        client's errors when the master cannot be reached.
        """
        cfg = storage_config
        extra = dict((cfg.extra_config if cfg is not None else None) or {})
        for k in sorted(set(extra) - set(EXTRA_CONFIG_KEYS) - _SGLANG_KEYS):
            log.warning("kvpool HiCache backend: unknown extra_config key %r ignored", k)
        if cfg is not None and getattr(cfg, "should_split_heads", False):
            raise ConfigError("kvpool HiCache backend: tp_lcm_size head splitting is not "
                              "supported (engines of one TP size share pages)")
        self.storage_config = cfg
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.is_mla = bool(cfg.is_mla_model) if cfg is not None else False
        # (SGLang releases before DCP have no is_storage_writer: rank 0 writes MLA)
        self.is_writer = cfg is None or bool(getattr(
            cfg, "is_storage_writer", not self.is_mla or cfg.tp_rank == 0))
        model = (cfg.model_name if cfg is not None else None) or "default"
        tag = str(extra.get("key_prefix") or "sglang")
        self.key_prefix = f"{tag}/{'-'.join(model.split('/'))}"
        self.tp_shard, self.mla_shard = self._shards(cfg)
        self.registered_pools: dict[Any, Any] = {}
        self.mem_pool_host: Any = None
        self._stats = _IOStats() if cfg is not None and cfg.enable_storage_metrics else None
        self._owns_client = client is None
        if client is None:
            overrides: dict[str, Any] = dict(extra.get("client_overrides") or {})
            for k in ("master_address", "tenant"):
                if extra.get(k):
                    overrides[k] = extra[k]
            client = Client(client_config_from_env(overrides, path=extra.get("client_config")))
            client.setup()
        self.client = client
        self._memory = _PoolMemory(client)
        if kwargs is not None and not isinstance(kwargs, Mapping) \
                and hasattr(kwargs, "get_page_buffer_meta"):
            self.register_mem_pool_host(kwargs)

    @staticmethod
    def _shards(cfg: HiCacheStorageConfig | None) -> tuple[str, str]:
        """(the TP-sharded shard tag, the rank-replicated one) of this rank."""
        if cfg is None:
            return "tp0of1", "mla"
        extra = ""
        if cfg.pp_size > 1:
            extra += f"-pp{cfg.pp_rank}of{cfg.pp_size}"
        cp = getattr(cfg, "attn_cp_size", 1)  # (absent from older SGLang releases)
        if cp > 1:
            extra += f"-cp{cfg.attn_cp_rank}of{cp}"
        mla = "mla" + extra
        dcp = getattr(cfg, "dcp_size", 1)
        if dcp > 1:  # an MLA shard per DCP rank; reuse needs the same TP and page
            mla += f"-tp{cfg.tp_size}-dcp{cfg.dcp_rank}of{dcp}-page{cfg.logical_page_size}"
        return f"tp{cfg.tp_rank}of{cfg.tp_size}{extra}", mla

    # ------------------------------------------------------------------ keys

    def _replicated(self, pool: str) -> bool:
        # MLA KV and its side pools are the same on every rank; Mamba state is TP-sharded
        return self.is_mla and pool != _kv(PoolName.MAMBA)

    @staticmethod
    def _format(host_pool: Any) -> str:
        # every layout orders a page's bytes its own way (page_first_direct too:
        # layer-major inside the page, where page_first is token-major), and two
        # KV dtypes of one width (fp16, bf16) would read as each other
        fmt = str(getattr(host_pool, "layout", "") or "na")
        dtype = getattr(host_pool, "dtype", None)
        return fmt if dtype is None else f"{fmt}-{str(dtype).removeprefix('torch.')}"

    def _keys(self, hashes: Sequence[str], pool: str = "kv", fmt: str | None = None) -> list[str]:
        if fmt is None:
            fmt = self._kv_format()
        shard = self.mla_shard if self._replicated(pool) else self.tp_shard
        return [page_object_key(self.key_prefix, fmt, shard, pool, h) for h in hashes]

    def _kv_format(self, zero_copy: bool | None = None) -> str:
        """The format of KV pages: the host layout (zero-copy objects) or
        ``flat-<layout>`` (SGLang's flat pages, flattened from that layout too)."""
        if self.mem_pool_host is None:
            raise ConfigError("kvpool HiCache backend: register_mem_pool_host was not called")
        fmt = self._format(self.mem_pool_host)
        return fmt if (self.zero_copy if zero_copy is None else zero_copy) else f"{_FLAT}-{fmt}"

    # ------------------------------------------------------------------ host pools

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Keep the host KV pool and register its buffers for zero-copy moves."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            return  # a logical anchor (DeepSeek V4): its side pools hold the data
        self._register_buffers(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Keep a hybrid model's side pool under its name and register its buffers."""
        self.registered_pools[host_pool_name] = host_pool
        if _kv(host_pool_name) != _kv(PoolName.KV):
            self._register_buffers(host_pool)

    def _register_buffers(self, host_pool: Any) -> None:
        get = getattr(host_pool, "get_hybrid_pool_buffer", None)
        buffers = get() if get is not None else [getattr(host_pool, "kv_buffer", None)]
        try:
            for buf in buffers:
                self._memory.register(buf)
        except KVPoolError as exc:  # unregistered memory still moves, with per-call setup
            log.warning("kvpool HiCache backend: registering host pool memory: %s", exc)

    # ------------------------------------------------------------------ zero-copy (v1)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (``page_size`` slots
        a key); per key True when the whole page was read."""
        if not keys:
            return []
        if getattr(self.mem_pool_host, "kv_buffer", None) is None:
            return [True] * len(keys)  # a logical anchor has no bytes of its own
        start = time.perf_counter()
        parts, totals = _page_parts(self._memory, self.mem_pool_host, host_indices, len(keys))
        ok = self._read(self._keys(keys), parts, totals)
        if self._stats is not None:
            self._stats.add("prefetch", len(keys), sum(totals), time.perf_counter() - start)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store pages from the host pool at ``host_indices``; per key True when
        stored (or already there). An MLA rank other than the writer stores
        nothing and answers True: the writer stores the one shared copy."""
        if not keys:
            return []
        if not self.is_writer or getattr(self.mem_pool_host, "kv_buffer", None) is None:
            return [True] * len(keys)
        start = time.perf_counter()
        parts, totals = _page_parts(self._memory, self.mem_pool_host, host_indices, len(keys))
        ok = self._write(self._keys(keys), parts)
        if self._stats is not None:
            self._stats.add("backup", len(keys), sum(totals), time.perf_counter() - start)
        return ok

    def _read(self, keys: list[str], parts: list[list[Any]], totals: list[int]) -> list[bool]:
        try:
            got = self.client.batch_get_parts(keys, parts)
        except KVPoolError as exc:
            log.warning("kvpool HiCache backend: read of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [n == total for n, total in zip(got, totals, strict=True)]

    def _write(self, keys: list[str], parts: list[list[Any]]) -> list[bool]:
        try:
            codes = self.client.batch_put_parts(keys, parts)
        except KVPoolError as exc:
            log.warning("kvpool HiCache backend: write of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [c in _STORED for c in codes]

    # ------------------------------------------------------------------ copying calls

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> Any | None:
        """Read one flat page into ``target_location`` (a CPU tensor); it, or
        None when the page is missing or of another size."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[Any | None]:
        """:meth:`get` for many pages: one master call, one transfer batch."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys) \
                or any(t is None for t in target_locations):
            raise ConfigError("kvpool HiCache backend: batch_get needs one target per key")
        flat = self._keys(keys, fmt=self._kv_format(zero_copy=False))
        try:
            got = self.client.batch_get_into(flat, list(target_locations))
        except KVPoolError as exc:
            log.warning("kvpool HiCache backend: read of %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        return [t if n == t.numel() * t.element_size() else None
                for n, t in zip(got, target_locations, strict=True)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        """Store one flat page (a CPU tensor); True when stored or already there."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None) -> bool:
        """Store many flat pages; True when every one is stored (or was)."""
        if not keys:
            return True
        if values is None or len(values) != len(keys) or any(v is None for v in values):
            raise ConfigError("kvpool HiCache backend: batch_set needs one value per key")
        if not self.is_writer:
            return True
        bufs = [v if v.is_contiguous() else v.contiguous() for v in values]
        flat = self._keys(keys, fmt=self._kv_format(zero_copy=False))
        return all(self._write(flat, [[b] for b in bufs]))

    # ------------------------------------------------------------------ existence

    def exists(self, key: str) -> bool:
        """Whether this rank's page of ``key`` is stored."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored (one master call)."""
        if not keys:
            return 0
        found = self._exist(self._keys(keys))
        return found.index(False) if False in found else len(found)

    def _exist(self, keys: list[str]) -> list[bool]:
        try:
            return self.client.batch_exists(keys)
        except KVPoolError as exc:
            log.warning("kvpool HiCache backend: exists of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)

    # ------------------------------------------------------------------ hybrid pools (v2)

    def _pool(self, name: Any) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None:
            # (a copy: a late side pool may register from another thread)
            pools = list(self.registered_pools.items())
            pool = next((p for n, p in pools if _kv(n) == _kv(name)), None)
        if pool is None and _kv(name) == _kv(PoolName.KV):
            pool = self.mem_pool_host
        if pool is None:
            raise ConfigError(f"kvpool HiCache backend: pool {_kv(name)!r} was not registered")
        return pool

    def _pool_keys(self, name: Any, hashes: Sequence[str]) -> list[str]:
        pool = _kv(name)
        if pool == _kv(PoolName.KV):
            return self._keys(hashes)
        return self._keys(hashes, pool, self._format(self._pool(name)))

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The longest KV prefix of ``keys`` whose side pools can be restored
        with it (ALL_PAGES: every page; TRAILING_PAGES: the last
        ``len(transfer.keys)`` pages), in one master call for every pool."""
        transfers = list(pool_transfers or [])
        for t in transfers:
            if t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise ConfigError(f"kvpool HiCache backend: hit policy {t.hit_policy} of pool "
                                  f"{_kv(t.name)} is not supported")
        anchor = getattr(self.mem_pool_host, "kv_buffer", None) is None
        query = [] if anchor else self._keys(keys)
        for t in transfers:
            query += self._pool_keys(t.name, keys)
        found = self._exist(query) if query else []
        n = len(keys)
        if anchor:
            kv_pages = n
        else:
            kv_pages = found.index(False) if False in found[:n] else n
            found = found[n:]
        hits: dict[str, int] = {_kv(PoolName.KV): kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for i, t in enumerate(transfers):
            have = found[i * n:(i + 1) * n]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                edge = have.index(False) if False in have[:kv_pages] else kv_pages
                ok = set(range(1, edge + 1))
            else:
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {p for p in range(1, kv_pages + 1)
                      if all(have[max(0, p - window):p])}
            if ok:
                hits[_kv(t.name)] = max(ok)
            restorable &= ok
        order = sorted(restorable)
        return PoolTransferResult(order[-1] if order else 0, hits, order)

    def _v2_pages(self, transfers: list[PoolTransfer], writing: bool
                  ) -> tuple[list[str], list[list[Any]], list[int], list[tuple[str, int, int]]]:
        keys: list[str] = []
        parts: list[list[Any]] = []
        totals: list[int] = []
        spans: list[tuple[str, int, int]] = []  # pool name, first key, count (-1: skipped)
        for t in transfers:
            name, hashes = _kv(t.name), list(t.keys or [])
            if writing and self._replicated(name) and not self.is_writer:
                spans.append((name, len(keys), -len(hashes) - 1))
                continue
            pool = self._pool(t.name)
            if name == _kv(PoolName.KV) and getattr(pool, "kv_buffer", None) is None:
                spans.append((name, len(keys), -len(hashes) - 1))
                continue
            p, s = _page_parts(self._memory, pool, t.host_indices, len(hashes))
            spans.append((name, len(keys), len(hashes)))
            keys += self._pool_keys(t.name, hashes)
            parts += p
            totals += s
        return keys, parts, totals, spans

    @staticmethod
    def _by_pool(spans: list[tuple[str, int, int]], ok: list[bool]) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for name, start, count in spans:
            out[name] = [True] * (-count - 1) if count < 0 else ok[start:start + count]
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read every transfer's pages into its pool (one master call, one
        transfer batch); per pool name, per key whether the page was read."""
        keys, parts, totals, spans = self._v2_pages(transfers, writing=False)
        return self._by_pool(spans, self._read(keys, parts, totals) if keys else [])

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store every transfer's pages from its pool; per pool name, per key
        whether it is stored. Rank-replicated pools are written by the writer only."""
        keys, parts, _, spans = self._v2_pages(transfers, writing=True)
        return self._by_pool(spans, self._write(keys, parts) if keys else [])

    # ------------------------------------------------------------------ admin

    def clear(self) -> None:
        """Remove every page of this model under this key prefix (every rank's,
        every layout's): SGLang's flush of the storage tier."""
        try:
            n = self.client.remove_by_regex("", force=True, prefix=self.key_prefix + "/")
            log.info("kvpool HiCache backend: cleared %d pages of %s", n, self.key_prefix)
        except KVPoolError as exc:
            log.warning("kvpool HiCache backend: clear failed: %s", exc)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics of the zero-copy calls since the last call
        (with ``enable_storage_metrics``; else None, as SGLang's default)."""
        if self._stats is None or not SGLANG_IMPORTED:
            return None
        from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found]
            StorageMetrics,
        )

        metrics = StorageMetrics()
        for name, values in self._stats.take().items():
            getattr(metrics, name).extend(values)
        return metrics

    def close(self) -> None:
        """Release the registered host memory and (if this backend made it) the client."""
        self._memory.release()
        if self._owns_client:
            self.client.close()
