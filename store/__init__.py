"""kvpool.store: the client (Put/Get with buffers, replicas, tiers), the
Mooncake-compatible class and the per-node daemon.

Names are imported lazily (PEP 562) so ``kvpool --help`` and the CLI stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.store.client import Client
    from kvpool.store.config import ClientConfig, ReplicateConfig, load_client_config
    from kvpool.store.mooncake import MooncakeDistributedStore

__all__ = [
    "Client",
    "ClientConfig",
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "load_client_config",
]

_WHERE = {
    "Client": "kvpool.store.client",
    "ClientConfig": "kvpool.store.config",
    "ReplicateConfig": "kvpool.store.config",
    "load_client_config": "kvpool.store.config",
    "MooncakeDistributedStore": "kvpool.store.mooncake",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
