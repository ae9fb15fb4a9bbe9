"""kvpool.store: the client (Put/Get with buffers, replicas, tiers), the
Mooncake-compatible class and the per-node daemon.

Names are imported lazily (PEP 562) so ``kvpool --help`` and the CLI stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.core.lazy import lazy_exports

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

__getattr__ = lazy_exports(__name__, {
    "kvpool.store.client": ["Client"],
    "kvpool.store.config": ["ClientConfig", "ReplicateConfig", "load_client_config"],
    "kvpool.store.mooncake": ["MooncakeDistributedStore"],
})
