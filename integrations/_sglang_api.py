"""SGLang's HiCache storage contract, for when SGLang itself is not importable.

:mod:`kvpool.integrations.sglang` subclasses SGLang's own classes when
``sglang.srt.mem_cache.hicache_storage`` imports (always so inside an SGLang
engine). Without SGLang (kvpool's CI, a node that only runs tests) it uses
these stand-ins instead: the same names, fields and method signatures as
SGLang 0.5.23 (the PyPI release; ``python/sglang/srt/mem_cache/
hicache_storage.py``), reduced to what a storage backend sees. Nothing here
is used when SGLang is present.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "SGLANG_CONTRACT_VERSION",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
]

SGLANG_CONTRACT_VERSION = "0.5.23"


@dataclass
class HiCacheStorageConfig:
    """What the cache controller tells a backend about its rank and model."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: str | None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict[str, Any] | None = None
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None

    @property
    def is_storage_writer(self) -> bool:
        """MLA replicas share one writer (rank ``dcp_rank``); MHA ranks all write."""
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


@dataclass
class HiCacheStorageExtraInfo:
    """Page hashes preceding a call's keys, and backend-specific extras."""

    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


class PoolName(str, Enum):  # noqa: UP042 (declared so by SGLang)
    """The pool names a hybrid model's :class:`PoolTransfer` carries (a subset)."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DRAFT = "draft"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, Enum):  # noqa: UP042 (declared so by SGLang)
    """How a side pool takes part in ``batch_exists_v2``'s prefix."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass
class PoolTransfer:
    """One pool's part of a v2 transfer: its pages' keys and host indices."""

    name: Any
    host_indices: Any = None
    device_indices: Any = None
    keys: list[str] | None = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: list[Any] | None = None
    indices_from_pool: Any = None
    block_pages: int = 0
    group_pages: int = 0


@dataclass
class PoolTransferResult:
    """``batch_exists_v2``'s answer: the usable KV prefix and each pool's hits."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[str, int]
    restorable_prefix_pages: list[int] | None = None


class HiCacheStorage(ABC):
    """SGLang's backend base class: the abstract methods and the v1/v2 hooks."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if not hasattr(self, "registered_pools"):
            self.registered_pools: dict[Any, Any] = {}
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:  # noqa: B027 (an optional hook)
        """The initial burst of pool registrations is over."""

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        raise NotImplementedError()

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        raise NotImplementedError()

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        raise NotImplementedError()

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        raise NotImplementedError()

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        raise NotImplementedError()

    @abstractmethod
    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> Any | None: ...

    @abstractmethod
    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[Any | None] | int: ...

    @abstractmethod
    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool: ...

    @abstractmethod
    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None) -> bool: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:  # noqa: B027 (optional, as in SGLang)
        """Remove every stored page (SGLang: a no-op unless overridden)."""

    def get_stats(self) -> Any:
        return None
