"""Mooncake-compatible API: ``kvpool.store.mooncake`` stands in for ``mooncake.store``.

Every method of Mooncake's ``MooncakeDistributedStore`` (0.3.12 and 0.3.13 /
main) and every module-level name of ``mooncake.store`` exists here with
Mooncake's signature, argument names, defaults and return conventions, so
code written for Mooncake runs on kvpool by changing its import::

    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from kvpool.store.mooncake import MooncakeDistributedStore, ReplicateConfig

This module is the table of those names; the store itself is the facade in
:mod:`~kvpool.store.mooncake_store`. docs/mooncake_compat.md lists every
name with what it does on kvpool.
"""

from __future__ import annotations

from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store.config import ObjectDataType, ReplicateConfig, SoftPinAction
from kvpool.store.mooncake_pool import (
    BufferLease,
    BufferLeaseView,
    BufferPool,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
)
from kvpool.store.mooncake_store import MooncakeDistributedStore
from kvpool.store.mooncake_tensor import (
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)
from kvpool.store.mooncake_types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeDistributedNoFRegister,
    MooncakeHostMemAllocator,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
)

__all__ = [
    "ACTIVATION", "COMPLETE", "FAILED", "GENERAL", "GRADIENT", "INITIALIZED", "KVCACHE",
    "METADATA", "OPTIMIZER_STATE", "PENDING", "PROCESSING", "REMOVED", "REPLICA_COPY",
    "REPLICA_MOVE", "SAMPLE", "SUCCESS", "TENSOR", "UNDEFINED", "UNKNOWN", "WEIGHT",
    "BufferHandle", "BufferLease", "BufferLeaseView", "BufferPool", "Descriptor",
    "DiskDescriptor", "EngramStore", "EngramStoreConfig", "MemoryDescriptor",
    "MooncakeDistributedNoFRegister", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
    "ObjectDataType", "ParallelAxis", "QueryTaskResponse", "ReadTarget",
    "RegisteredBufferLease", "RegisteredBufferLeaseView", "RegisteredBufferPool",
    "ReplicaDescriptor", "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus",
    "TaskType", "TensorParallelism", "_deserialize_tensor", "_get_pyclient_from_wrapper",
    "_serialize_tensor", "_tensor_metadata_size", "bind_to_numa_node", "get_alloc_func_addr",
    "get_free_func_addr",
]

# pybind's export_values(): the enum members are module attributes too (where
# names clash the later enum wins, as in Mooncake: TaskStatus over ReplicaStatus)
UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE = (ObjectDataType.UNKNOWN, ObjectDataType.KVCACHE,
                                            ObjectDataType.TENSOR, ObjectDataType.WEIGHT,
                                            ObjectDataType.SAMPLE)
ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, GENERAL = (
    ObjectDataType.ACTIVATION, ObjectDataType.GRADIENT, ObjectDataType.OPTIMIZER_STATE,
    ObjectDataType.METADATA, ObjectDataType.GENERAL)
UNDEFINED, INITIALIZED, COMPLETE, REMOVED = (ReplicaStatus.UNDEFINED, ReplicaStatus.INITIALIZED,
                                             ReplicaStatus.COMPLETE, ReplicaStatus.REMOVED)
REPLICA_COPY, REPLICA_MOVE = TaskType.REPLICA_COPY, TaskType.REPLICA_MOVE
PENDING, PROCESSING, FAILED, SUCCESS = (TaskStatus.PENDING, TaskStatus.PROCESSING,
                                        TaskStatus.FAILED, TaskStatus.SUCCESS)


class EngramStoreConfig:
    """Mooncake's Engram (embedding table) store configuration: kvpool has no
    Engram store (see :class:`EngramStore`)."""


class EngramStore:
    """Mooncake's Engram embedding-table store. kvpool has no equivalent:
    constructing one raises ``KVPoolError(NOT_SUPPORTED)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise KVPoolError("kvpool has no Engram (embedding-table) store",
                          ErrorCode.NOT_SUPPORTED)


def _get_pyclient_from_wrapper(wrapper: MooncakeDistributedStore) -> Any:
    """Mooncake-internal: its C++ client handle for EngramStore. kvpool returns
    the store's :class:`~kvpool.store.client.Client` (None when not set up)."""
    return wrapper._get_pyclient_capsule()
