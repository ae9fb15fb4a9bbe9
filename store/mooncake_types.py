"""The plain types of Mooncake's ``mooncake.store`` module, for kvpool.

Names, fields, defaults and enum values follow Mooncake 0.3.12/0.3.13 so code
that builds or inspects them runs unchanged: replica descriptors returned by
``get_replica_desc``, copy/move task records, ``BufferHandle`` (an object's
bytes, usable wherever Python takes a buffer), the parallel-tensor request
types, ``MooncakeHostMemAllocator`` and the small module-level functions.
What each does on kvpool is in docs/mooncake_compat.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from enum import IntEnum

from kvpool.store.mooncake_codes import NOT_SUPPORTED

__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedNoFRegister",
    "MooncakeHostMemAllocator",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "bind_to_numa_node",
    "get_alloc_func_addr",
    "get_free_func_addr",
]

log = logging.getLogger(__name__)



class _Enum(IntEnum):
    """An int enum printed like pybind11's (``ReplicaStatus.COMPLETE``)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class ReplicaStatus(_Enum):
    """Mooncake's replica states (values as Mooncake's)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(_Enum):
    """Kind of a replica copy/move task."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(_Enum):
    """State of a copy/move task (values as Mooncake's)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


@dataclass
class QueryTaskResponse:
    """What ``query_task`` reports about a copy/move task. Ids are Mooncake's
    UUID pairs ``(high, low)``; times are epoch milliseconds."""

    id: tuple[int, int] = (0, 0)
    type: TaskType = TaskType.REPLICA_COPY
    status: TaskStatus = TaskStatus.PENDING
    created_at_ms_epoch: int = 0
    last_updated_at_ms_epoch: int = 0
    assigned_client: tuple[int, int] = (0, 0)
    message: str = ""


@dataclass
class Descriptor:
    """A memory replica's location: ``size`` bytes at ``buffer_address`` (the
    offset inside its segment on kvpool) served by ``transport_endpoint``
    (``host:port`` of the segment's transfer server)."""

    size: int = 0
    buffer_address: int = 0
    transport_endpoint: str = ""

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


@dataclass
class MemoryDescriptor:
    """The memory part of a replica descriptor."""

    buffer_descriptor: Descriptor = field(default_factory=Descriptor)


@dataclass
class DiskDescriptor:
    """The disk part of a replica descriptor (kvpool: the SSD-tier segment file)."""

    file_path: str = ""
    object_size: int = 0


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` returns it."""

    __slots__ = ("_disk", "_local", "_memory", "segment_id", "status")

    def __init__(self, status: ReplicaStatus, segment_id: str = "",
                 memory: MemoryDescriptor | None = None, disk: DiskDescriptor | None = None,
                 local: bool = False) -> None:
        self.status = status
        self.segment_id = segment_id  # kvpool's segment id (Mooncake's segment name)
        self._memory = memory
        self._disk = disk
        self._local = local

    def is_memory_replica(self) -> bool:
        return self._memory is not None

    def is_disk_replica(self) -> bool:
        return self._disk is not None

    def is_local_disk_replica(self) -> bool:
        """A disk replica held by this host (read without a network hop)."""
        return self._disk is not None and self._local

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._memory is None:
            raise RuntimeError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise RuntimeError("not a disk replica")
        return self._disk

    def __repr__(self) -> str:
        kind = "memory" if self._memory is not None else "disk"
        return f"ReplicaDescriptor({kind}, {self.segment_id!r}, {self.status.name})"


class BufferHandle(bytearray):
    """An object's bytes owned by the caller (``get_buffer``/``batch_get_buffer``).

    Supports Python's buffer protocol like Mooncake's (``memoryview(h)``,
    ``np.array(h, copy=False)``, ``torch.frombuffer(h, ...)``), plus
    ``ptr()`` (its address) and ``size()``. The memory lives as long as the
    handle; kvpool reads the object straight into it.
    """

    def ptr(self) -> int:
        """Address of the first byte (0 for an empty handle)."""
        if not len(self):
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


@dataclass
class ParallelAxis:
    """One axis of a shard identity: ``kind`` one of "tp", "dp", "ep", "pp"."""

    kind: str = ""
    rank: int = 0
    size: int = 1
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None


@dataclass
class TensorParallelism:
    """An ordered list of :class:`ParallelAxis` naming a stored or wanted shard."""

    axes: list[ParallelAxis] = field(default_factory=list)


_READ_MODES = ("as_stored", "shard", "full")


class ReadTarget:
    """What a tensor read materialises: ``mode`` "as_stored" (default),
    "shard" (``parallelism`` required) or "full" (reconstructed)."""

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if str(value).lower() not in _READ_MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = str(value).lower()


class MooncakeHostMemAllocator:
    """Host memory for a standalone-mode engine (SGLang's host KV pool).

    Mooncake hands out shared memory mapped by the local client daemon; on
    kvpool any host memory is readable and writable by the engine's thin
    client (the daemon's segment is mapped into the engine instead), so this
    returns page-aligned anonymous mappings. ``alloc(size)`` returns the
    address (0 on failure), ``free(ptr)`` 0 or -1 (unknown address).
    """

    _lock = threading.Lock()
    _maps: dict[int, mmap.mmap] = {}

    def alloc(self, size: int) -> int:
        if int(size) <= 0:
            return 0
        try:
            m = mmap.mmap(-1, int(size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError) as exc:
            log.error("MooncakeHostMemAllocator.alloc(%d): %s", size, exc)
            return 0
        # the temporary view's export ends with it, so free() can close the map
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        with self._lock:
            self._maps[int(addr)] = m
        return int(addr)

    def free(self, ptr: int) -> int:
        with self._lock:
            m = self._maps.pop(int(ptr), None)
        if m is None:
            return -1
        try:
            m.close()
        except BufferError:  # still viewed by a live tensor: leave it to GC
            with self._lock:
                self._maps[int(ptr)] = m
            return -1
        return 0


class MooncakeDistributedNoFRegister:
    """Mooncake's NVMe-oF target registration. kvpool's SSD tier is local
    file segments (``kvpool client --disk-dir``); there is no NVMe-oF pool,
    so both calls return NOT_SUPPORTED."""

    def real_register(self, nqn: str = "", nsid: int = 1, traddr: str = "",
                      trsvcid: int = 4420, base: int = 0, size: int = 1024,
                      master_server_addr: str = "127.0.0.1:50051") -> int:
        log.warning("MooncakeDistributedNoFRegister.real_register: kvpool has no NVMe-oF "
                    "pool; use `kvpool client --disk-dir DIR --disk SIZE` for the SSD tier")
        return NOT_SUPPORTED

    def real_unregister_by_endpoint(self, nqn: str = "", nsid: int = 1, traddr: str = "",
                                    trsvcid: int = 4420,
                                    master_server_addr: str = "127.0.0.1:50051") -> int:
        return NOT_SUPPORTED


def _node_cpus(node: int) -> set[int] | None:
    path = f"/sys/devices/system/node/node{int(node)}/cpulist"
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_numa_node(node: int) -> None:
    """Run the calling thread on the CPUs of NUMA ``node`` (what Mooncake's
    does; memory placement follows first touch). Logs a warning and does
    nothing where the node does not exist."""
    cpus = _node_cpus(node)
    if not cpus:
        log.warning("NUMA node %s is not available on this system; binding skipped", node)
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("binding to NUMA node %s failed: %s", node, exc)


def _libc_fn(name: str) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    addr = ctypes.cast(getattr(libc, name), ctypes.c_void_p).value
    return int(addr or 0)


def get_alloc_func_addr() -> int:
    """Address of a C allocation function ``void *f(size_t)`` for custom
    allocators. Mooncake's is its hugepage allocator; kvpool has none and
    returns libc's ``malloc``."""
    return _libc_fn("malloc")


def get_free_func_addr() -> int:
    """Address of the matching free function (libc's ``free``)."""
    return _libc_fn("free")
