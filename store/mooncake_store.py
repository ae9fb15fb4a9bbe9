"""``MooncakeDistributedStore``: the facade of the Mooncake-compatible store.

Every method of Mooncake's ``MooncakeDistributedStore`` (0.3.12 and 0.3.13 /
main) with Mooncake's signature, argument names, defaults and return
conventions: ``0`` or a count on success, a negative ``ErrorCode`` integer on
failure, ``b""``/``None`` for a missing object; no method raises for a store
error (a wrong argument *type* raises ``TypeError``); kvpool's results
become these integers in :mod:`~kvpool.store.mooncake_codes` only.

Each method hands its call to the room that does that job, one call deep:
:mod:`~kvpool.store.mooncake_setup` (setup, close, health),
:mod:`~kvpool.store.mooncake_bytes` (bytes values, queries, removal),
:mod:`~kvpool.store.mooncake_objects` (the one whole-object write and staged
read), :mod:`~kvpool.store.mooncake_zerocopy` (pointers, multi-buffers,
ranges), :mod:`~kvpool.store.mooncake_session` (session ranges),
:mod:`~kvpool.store.mooncake_tensor_calls` and
:mod:`~kvpool.store.mooncake_tensor_parallel` (tensors in Mooncake's layout,
:mod:`~kvpool.store.mooncake_tensor`), :mod:`~kvpool.store.mooncake_admin`
(segments, replica descriptors, copy/move tasks). The single-key form of a
batch call is a batch of one. Import it from :mod:`kvpool.store.mooncake`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.core.tenants import DEFAULT_TENANT
from kvpool.store.client import Client
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_admin import AdminCalls, not_supported
from kvpool.store.mooncake_bytes import BytesCalls, part_views
from kvpool.store.mooncake_core import MooncakeCore
from kvpool.store.mooncake_memory import CallerMemory
from kvpool.store.mooncake_objects import ObjectIO
from kvpool.store.mooncake_session import SessionCalls
from kvpool.store.mooncake_setup import DEFAULT_CLIENT_HTTP_PORT, DEFAULT_SEGMENT, Lifecycle
from kvpool.store.mooncake_tensor_calls import TensorCalls
from kvpool.store.mooncake_tensor_parallel import ParallelTensorCalls, tp_keys
from kvpool.store.mooncake_types import BufferHandle, QueryTaskResponse, ReplicaDescriptor
from kvpool.store.mooncake_zerocopy import ZeroCopyCalls

__all__ = ["MooncakeDistributedStore"]

Keys = Sequence[str]
Ptrs = Sequence[int]
Config = ReplicateConfig | None


def _listed(value: Any) -> list[Any] | None:
    """A single-key call's optional per-key argument as its batch form's list."""
    return None if value is None else [value]


def _rooms(core: MooncakeCore) -> tuple[CallerMemory, ObjectIO, SessionCalls, Lifecycle,
                                          BytesCalls, ZeroCopyCalls, TensorCalls,
                                          ParallelTensorCalls, AdminCalls]:
    """The rooms of one store over ``core``, in the order the facade keeps them."""
    memory, io = CallerMemory(core), ObjectIO(core)
    sessions, zero_copy = SessionCalls(core, memory), ZeroCopyCalls(core, memory, io)
    tensors = TensorCalls(core, memory, io, zero_copy)
    return (memory, io, sessions, Lifecycle(core, memory, sessions), BytesCalls(core, io),
            zero_copy, tensors, ParallelTensorCalls(io, tensors), AdminCalls(core))


class MooncakeDistributedStore:
    """Drop-in for ``mooncake.store.MooncakeDistributedStore`` (module docstring)."""

    def __init__(self) -> None:
        self._core = core = MooncakeCore()
        (self._memory, self._io, self._sessions, self._life, self._bytes, self._zero_copy,
         self._tensors, self._parallel, self._admin) = _rooms(core)

    @property
    def _client(self) -> Client | None:
        """The kvpool client behind the store (None when not set up)."""
        return self._core.client

    def _c(self) -> Client:
        """The kvpool client; KVPoolError(INVALID_PARAMS) when not set up."""
        return self._core.live()

    def __del__(self) -> None:
        # a store dropped without close() unmounts like Mooncake's destructor
        try:
            if getattr(self, "_core", None) is not None and self._core.client is not None:
                self.close()
        except Exception:  # interpreter shutdown: best effort only
            pass

    # ------------------------------------------------------------------ lifecycle

    def setup(self, local_hostname: str | Mapping[str, Any] | None = None,
              metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: int = DEFAULT_SEGMENT,
              local_buffer_size: int = DEFAULT_SEGMENT, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051",
              engine: Any = None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = DEFAULT_TENANT, enable_client_http_server: bool = False,
              client_http_port: int = DEFAULT_CLIENT_HTTP_PORT, *,
              config: Mapping[str, Any] | None = None) -> int:
        """Connect to the master at ``master_server_addr``, contribute
        ``global_segment_size`` bytes of memory and start this store's transfer
        server on ``local_hostname`` (``host`` or ``host:port``). Also
        ``setup(config_dict)`` with the same keys as strings or values.

        ``enable_ssd_offload``: this store gets an SSD tier under
        ``ssd_offload_path`` (or ``$MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``), or,
        without a path, the disk tier of a node daemon on this host serves it;
        neither is an error. ``tenant_id`` is the tenant the store acts for
        (docs/tenants.md): its keys, removals and quota are that tenant's;
        the default leaves the tenant to ``$KVPOOL_CONFIG``'s ``tenant``
        (else ``default``).
        ``metadata_server``, ``rdma_devices`` and ``engine`` are accepted and
        not needed. Returns 0 or a negative code.
        """
        return self._life.setup(local_hostname, metadata_server, global_segment_size,
                                local_buffer_size, protocol, rdma_devices, master_server_addr,
                                engine, enable_ssd_offload, ssd_offload_path, tenant_id,
                                enable_client_http_server, client_http_port, config)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str) -> int:
        """Standalone mode: a thin client in the engine process, the memory
        (and disk) held by the node daemon on this host (``kvpool client``).
        Connects to the master named by ``$KVPOOL_CONFIG`` when set, else to
        ``server_address``; contributes nothing. -1 when no node daemon on this
        host contributes memory. ``mem_pool_size`` is accepted."""
        return self._life.setup_dummy(mem_pool_size, local_buffer_size, server_address)

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = DEFAULT_SEGMENT) -> int:
        """Mooncake's older one-call init: sets up on ``localhost`` with the
        default master (127.0.0.1:50051); INVALID_PARAMS once set up."""
        return self._life.init_all(protocol, device_name, mount_segment_size)

    def close(self) -> int:
        """Unmount this store's memory segment and release everything; its
        objects leave the pool (its SSD tier stays for a restart). Idempotent;
        the store can be set up again afterwards. Returns 0."""
        return self._life.close()

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        return self._life.health_check()

    def get_hostname(self) -> str:
        """``host:port`` naming this store's segment (Mooncake's format; usable
        as ``ReplicateConfig.preferred_segment``); "" when not set up."""
        return self._core.hostname

    # ------------------------------------------------------------------ bytes (staged)

    def put(self, key: str, value: Any, config: Config = None) -> int:
        """Store ``value`` (bytes-like). 0 also when the key exists (its value is
        kept); -600 for an empty key or value, or one above ``local_buffer_size``."""
        return self._bytes.put(key, value, config)

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` when missing, unreadable or larger than
        ``local_buffer_size``."""
        return self._bytes.get(key)

    def put_batch(self, keys: Keys, values: Sequence[Any], config: Config = None) -> int:
        """Put many values: 0 when every key is stored (or existed), else the
        first negative code. One master RPC, one transfer batch."""
        return self._bytes.write_values(keys, values, config, upsert=False)

    def get_batch(self, keys: Keys) -> list[bytes]:
        """Values in key order, ``b""`` where missing. (Mooncake answers ``[b""]``
        for an empty key list; kvpool answers ``[]``.)"""
        return self._bytes.get_batch(keys)

    def put_parts(self, key: str, *parts: Any, config: Config = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like objects, else
        RuntimeError) as one object, without joining them. Codes as :meth:`put`."""
        return self._bytes.write([key], [part_views(parts)], config, upsert=False)[0]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value of ``key`` in a :class:`BufferHandle` (buffer protocol),
        or None when missing or unreadable."""
        return self._io.read([key])[0]

    def batch_get_buffer(self, keys: Keys) -> list[BufferHandle | None]:
        """:meth:`get_buffer` for many keys: one master RPC, one transfer batch."""
        return self._io.read(keys)

    def upsert(self, key: str, value: Any, config: Config = None) -> int:
        """Insert ``value`` under ``key`` or replace the existing value: readers
        see the old value until the new one is committed. 0 or a negative code
        (-600 as :meth:`put`, and for ``soft_pin_ttl_ms`` without ENABLE)."""
        return self._bytes.write([key], [[memoryview(value)]], config, upsert=True)[0]

    def upsert_parts(self, key: str, *parts: Any, config: Config = None) -> int:
        """:meth:`upsert` of the concatenation of ``parts``."""
        return self._bytes.write([key], [part_views(parts)], config, upsert=True)[0]

    def upsert_batch(self, keys: Keys, values: Sequence[Any], config: Config = None) -> int:
        """:meth:`upsert` for many keys; 0 or the first negative code. A key
        given twice ends with its last value."""
        return self._bytes.write_values(keys, values, config, upsert=True)

    # ------------------------------------------------------------------ queries, removal

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not (also for an empty key), -1 on error.
        Grants a read lease, as Mooncake's query."""
        return self._bytes.is_exist(key)

    def batch_is_exist(self, keys: Keys) -> list[int]:
        """1/0/-1 per key in input order; [] for []."""
        return self._bytes.exist(keys)

    def get_size(self, key: str) -> int:
        """Size of ``key``'s value, or a negative code (-704 when missing)."""
        return self._bytes.get_size(key)

    def remove(self, key: str, force: bool = False) -> int:
        """0 when removed; -706 OBJECT_HAS_LEASE while a read lease is held
        (unless ``force``); -704 when missing."""
        return self._bytes.remove([key], force)[0]

    def batch_remove(self, keys: Keys, force: bool = False) -> list[int]:
        """:meth:`remove` for many keys in one RPC; per key 0 or a negative code."""
        return self._bytes.remove(keys, force)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key of this store's tenant matching ``regex_pattern``
        (``re.search``; unleased ones, or all with ``force``): the count, or a
        negative code (-600 for a bad pattern). One master RPC."""
        return self._bytes.remove_where(regex_pattern, force)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object of this store's tenant (unleased ones, or all
        with ``force``): the count, or a negative code. One master RPC."""
        return self._bytes.remove_all(force)

    # ------------------------------------------------------------------ zero copy

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` (host or GPU) for zero-copy
        calls; registering the same address again replaces it. 0 or negative."""
        return self._memory.register_buffer(buffer_ptr, size)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Release a :meth:`register_buffer` region; INVALID_PARAMS if unknown."""
        return self._memory.unregister_buffer(buffer_ptr)

    def alloc_from_mem_pool(self, size: int) -> int:
        """Standalone mode (``setup_dummy``): the address of ``size`` bytes of
        host memory for the zero-copy calls, at most ``mem_pool_size`` in all,
        freed at ``close()``; 0 when spent. After ``setup``: 0 (Mooncake's real
        client too; kvpool needs no pool for zero-copy calls)."""
        return self._life.alloc_from_mem_pool(size)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Config = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr``. 0 (also for an existing key,
        whose value is kept, and for ``size`` 0, which stores nothing) or a
        negative code."""
        return self._zero_copy.put_from(key, buffer_ptr, size, config)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into ``size`` bytes at ``buffer_ptr``: the bytes read, or
        a negative code (-704 missing, -600 buffer too small: nothing read)."""
        return self._zero_copy.get_into(key, buffer_ptr, size)

    def batch_put_from(self, keys: Keys, buffer_ptrs: Ptrs, sizes: Sequence[int],
                       config: Config = None) -> list[int]:
        """:meth:`put_from` for many keys: one master RPC, one transfer batch.
        Every key -600 when the lists differ in length; -600 for a size 0."""
        return self._zero_copy.batch_put_from(keys, buffer_ptrs, sizes, config)

    def batch_get_into(self, keys: Keys, buffer_ptrs: Ptrs, sizes: Sequence[int]) -> list[int]:
        """:meth:`get_into` for many keys: one master RPC, one transfer batch.
        Every key -600 when the lists differ in length."""
        return self._zero_copy.batch_get_into(keys, buffer_ptrs, sizes)

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int, config: Config = None) -> int:
        """Store ``[metadata][data]`` (metadata first) from two buffers as one
        object. 0 or a negative code; 0 without storing for ``size`` 0."""
        return self._zero_copy.put_from_with_metadata(key, buffer_ptr, metadata_buffer_ptr,
                                                      size, metadata_size, config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Config = None) -> int:
        """Insert or replace ``key`` with ``size`` bytes at ``buffer_ptr``."""
        return self._zero_copy.upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: Keys, buffer_ptrs: Ptrs, sizes: Sequence[int],
                          config: Config = None) -> list[int]:
        """:meth:`upsert_from` for many keys; per key 0 or a negative code."""
        return self._zero_copy.upsert_from(keys, buffer_ptrs, sizes, config)

    def batch_put_from_multi_buffers(self, keys: Keys, all_buffer_ptrs: Sequence[Ptrs],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: Config = None) -> list[int]:
        """Store each key's object as the concatenation of its buffers: one
        master RPC and one transfer batch. Per key 0 (also when it exists) or a
        negative code (-600: list lengths differ, or the buffers hold 0 bytes)."""
        return self._zero_copy.put_multi(keys, all_buffer_ptrs, all_sizes, config)

    def batch_get_into_multi_buffers(self, keys: Keys, all_buffer_ptrs: Sequence[Ptrs],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Scatter each key's object over its buffers in order: one master RPC,
        one transfer batch. Per key the object size, or a negative code (-704
        missing, -600 buffers too small or list lengths differ).
        ``prefer_alloc_in_same_node`` is accepted (the nearest replica is read)."""
        return self._zero_copy.get_multi(keys, all_buffer_ptrs, all_sizes)

    def get_into_ranges(self, buffer_ptrs: Ptrs, all_keys: Sequence[Keys],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Gather byte ranges of objects into registered buffers (buffer-major):
        ``all_sizes[i][j][k]`` bytes from ``all_src_offsets[i][j][k]`` of object
        ``all_keys[i][j]`` land at ``all_dst_offsets[i][j][k]`` of
        ``buffer_ptrs[i]``. ``results[i][j][k]``: the bytes read or a negative
        code (-704 missing; -600 bad shape, range or unregistered buffer)."""
        return self._zero_copy.get_into_ranges(buffer_ptrs, all_keys, all_dst_offsets,
                                               all_src_offsets, all_sizes)

    # ------------------------------------------------------------------ sessions

    def batch_get_session_start(self, keys: Keys) -> list[int]:
        """Locate ``keys`` once (one master RPC; a read lease each) for
        :meth:`batch_get_into_multi_buffer_ranges`. Per key 0 or a negative
        code (-704 missing)."""
        return self._sessions.get_start(keys)

    def batch_get_into_multi_buffer_ranges(self, keys: Keys, all_buffer_ptrs: Sequence[Ptrs],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]
                                           ) -> list[int]:
        """Read ranges of session objects, no master RPC: ``all_sizes[i][j]``
        bytes from offset ``all_src_offsets[i][j]`` into ``all_buffer_ptrs[i][j]``.
        Per key the bytes read, or -600 (no session, bad range), -707 (lease ended)."""
        return self._sessions.get_ranges(keys, all_buffer_ptrs, all_sizes, all_src_offsets)

    def batch_get_session_end(self, keys: Keys) -> int:
        """Drop the get sessions of ``keys`` (their leases simply run out). 0."""
        return self._sessions.get_end(keys)

    def batch_put_session_start(self, keys: Keys, sizes: Sequence[int],
                                config: Config = None) -> list[int]:
        """Reserve ``sizes[i]`` bytes for each key (one master RPC, no data).
        Per key 0, -705 (exists), -600 (a session is already open, bad size)."""
        return self._sessions.put_start(keys, sizes, config)

    def batch_put_from_multi_buffer_ranges(self, keys: Keys, all_buffer_ptrs: Sequence[Ptrs],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]
                                           ) -> list[int]:
        """Write buffers into ranges of session objects, no master RPC: key i's
        ``all_sizes[i][j]`` bytes at object offset ``all_dst_offsets[i][j]``.
        Per key the bytes written, or -600 (no session, range outside the object)."""
        return self._sessions.put_ranges(keys, all_buffer_ptrs, all_sizes, all_dst_offsets)

    def batch_put_session_end(self, keys: Keys) -> list[int]:
        """Commit put sessions: the objects become readable. Per key 0 or a
        negative code (-600 no session)."""
        return self._sessions.put_finish(keys, commit=True)

    def batch_put_session_revoke(self, keys: Keys) -> list[int]:
        """Abort put sessions and release their space. Per key 0 or -600."""
        return self._sessions.put_finish(keys, commit=False)

    # ------------------------------------------------------------------ tensors

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor (CPU or CUDA) as a Mooncake tensor object. 0 or
        a negative code (-600: not a tensor, unsupported dtype)."""
        return self._tensors.put([key], [tensor], None, upsert=False)[0]

    def pub_tensor(self, key: str, tensor: Any, config: Config = None) -> int:
        """:meth:`put_tensor` with a ReplicateConfig."""
        return self._tensors.put([key], [tensor], config, upsert=False)[0]

    def batch_put_tensor(self, keys: Keys, tensors_list: Sequence[Any]) -> list[int]:
        """:meth:`put_tensor` for many keys (one master RPC, one transfer batch)."""
        return self._tensors.put(keys, tensors_list, None, upsert=False)

    def batch_pub_tensor(self, keys: Keys, tensors_list: Sequence[Any],
                         config: Config = None) -> list[int]:
        """:meth:`pub_tensor` for many keys; -600 for every key on mismatched lengths."""
        return self._tensors.put(keys, tensors_list, config, upsert=False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Insert or replace a tensor object."""
        return self._tensors.put([key], [tensor], None, upsert=True)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Config = None) -> int:
        """:meth:`upsert_tensor` with a ReplicateConfig."""
        return self._tensors.put([key], [tensor], config, upsert=True)[0]

    def batch_upsert_tensor(self, keys: Keys, tensors_list: Sequence[Any]) -> list[int]:
        """:meth:`upsert_tensor` for many keys."""
        return self._tensors.put(keys, tensors_list, None, upsert=True)

    def batch_upsert_pub_tensor(self, keys: Keys, tensors_list: Sequence[Any],
                                config: Config = None) -> list[int]:
        """:meth:`upsert_pub_tensor` for many keys."""
        return self._tensors.put(keys, tensors_list, config, upsert=True)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (CPU), or None."""
        return self._tensors.get([key])[0]

    def batch_get_tensor(self, keys: Keys) -> list[Any]:
        """Tensors in key order, None where missing (one master RPC)."""
        return self._tensors.get(keys)

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read the tensor object into ``[buffer_ptr, +size)`` (host memory) and
        return a tensor viewing its data there, or None."""
        return self._tensors.get_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Keys, buffer_ptrs: Ptrs,
                              sizes: Sequence[int]) -> list[Any]:
        """:meth:`get_tensor_into` for many keys; a list of -600 on mismatched lengths."""
        return self._tensors.get_into(keys, buffer_ptrs, sizes)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` laid out as
        ``[TensorMetadata][data]`` (checked first; -600 when invalid)."""
        return self._tensors.put_from([key], [buffer_ptr], [size], upsert=False)[0]

    def batch_put_tensor_from(self, keys: Keys, buffer_ptrs: Ptrs,
                              sizes: Sequence[int]) -> list[int]:
        """:meth:`put_tensor_from` for many keys."""
        return self._tensors.put_from(keys, buffer_ptrs, sizes, upsert=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """:meth:`put_tensor_from`, inserting or replacing."""
        return self._tensors.put_from([key], [buffer_ptr], [size], upsert=True)[0]

    def batch_upsert_tensor_from(self, keys: Keys, buffer_ptrs: Ptrs,
                                 sizes: Sequence[int]) -> list[int]:
        """:meth:`upsert_tensor_from` for many keys."""
        return self._tensors.put_from(keys, buffer_ptrs, sizes, upsert=True)

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Read the stored tensor's data straight into ``tensor`` (CUDA or CPU;
        dtype and size must match). Bytes read or a negative code (-600:
        mismatch or not a tensor object)."""
        return self._tensors.get_into_tensors([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Keys, tensors_list: Sequence[Any]) -> list[int]:
        """:meth:`get_tensor_into_cuda` for many keys: one master RPC, then the
        304-byte headers, then every payload in one transfer batch."""
        return self._tensors.get_into_tensors(keys, tensors_list)

    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor under ``key`` to a safetensors file (``file_name``,
        default the key) holding it under the name ``key``. 0 or negative."""
        return self._tensors.save_safetensor(key, file_name)

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Load a tensor from a safetensors file and store it under ``key``
        (default: the file name); the entry named ``key``, else the file's
        first (logged). Returns the tensor, or None."""
        return self._tensors.load_safetensor(key, file_name)

    # ------------------------------------------------------------------ tensor parallelism

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Split ``tensor`` into ``tp_size`` equal shards along ``split_dim`` and
        store every shard as ``key_tp_<rank>`` (one batch; ``tp_rank`` is
        accepted for the signature). ``tp_size`` 1: :meth:`put_tensor`."""
        return self._parallel.put_with_tp([key], [tensor], None, tp_size, split_dim)[0]

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: Config = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """:meth:`put_tensor_with_tp` with a ReplicateConfig."""
        return self._parallel.put_with_tp([key], [tensor], config, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: Keys, tensors_list: Sequence[Any],
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        """:meth:`put_tensor_with_tp` for many keys, every shard in one batch."""
        return self._parallel.put_with_tp(base_keys, tensors_list, None, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: Keys, tensors_list: Sequence[Any],
                                 config: Config = None, tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        """Every tensor's TP shards in one batch; per base key 0 or the first
        shard's error (-600 for non-uniform sharding)."""
        return self._parallel.put_with_tp(base_keys, tensors_list, config, tp_size, split_dim)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """The shard ``key_tp_<tp_rank>`` (``tp_size`` > 1) or the tensor at ``key``."""
        return self._tensors.get(tp_keys([key], tp_rank, tp_size))[0]

    def batch_get_tensor_with_tp(self, base_keys: Keys, tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        """:meth:`get_tensor_with_tp` for many keys (one master RPC)."""
        return self._tensors.get(tp_keys(base_keys, tp_rank, tp_size))

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        """:meth:`get_tensor_with_tp` read into ``[buffer_ptr, +size)`` (as
        :meth:`get_tensor_into`)."""
        return self._tensors.get_into(tp_keys([key], tp_rank, tp_size), [buffer_ptr], [size])[0]

    def batch_get_tensor_with_tp_into(self, base_keys: Keys, buffer_ptrs: Ptrs,
                                      sizes: Sequence[int], tp_rank: int = 0,
                                      tp_size: int = 1) -> list[Any]:
        """:meth:`get_tensor_with_tp_into` for many keys."""
        return self._tensors.get_into(tp_keys(base_keys, tp_rank, tp_size), buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """:meth:`put_tensor_with_tp` of a full tensor serialized at ``buffer_ptr``."""
        return self._parallel.put_with_tp_from([key], [buffer_ptr], [size], tp_size,
                                               split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Keys, buffer_ptrs: Ptrs,
                                      sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        """:meth:`put_tensor_with_tp_from` for many keys."""
        return self._parallel.put_with_tp_from(base_keys, buffer_ptrs, sizes, tp_size,
                                               split_dim)

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: Config = None, writer_partition: Any = None) -> int:
        """Store a tensor under Mooncake's parallel layout: ``parallelism`` None
        (and no ``writer_partition``): the full tensor at ``key``; a single TP
        axis: ``tensor`` is that rank's shard (``key_tp_<rank>``); TP in a
        multi-axis layout: ``tensor`` is full, this rank's shard is derived;
        DP/EP/PP only: stored as given under the axis key; ``writer_partition``
        (rank, size, split_dim): the writer's shard of a full tensor. TP layouts
        and writer partitions also store a manifest. 0 or a negative code."""
        return self._parallel.put([key], [tensor], _listed(parallelism), config,
                                  _listed(writer_partition), upsert=False)[0]

    def batch_put_tensor_with_parallelism(self, keys: Keys, tensors_list: Sequence[Any],
                                          parallelisms: Sequence[Any] | None = None,
                                          config: Config = None,
                                          writer_partitions: Sequence[Any] | None = None
                                          ) -> list[int]:
        """:meth:`put_tensor_with_parallelism` for many keys, in one batch."""
        return self._parallel.put(keys, tensors_list, parallelisms, config, writer_partitions,
                                  upsert=False)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: Config = None,
                                       writer_partition: Any = None) -> int:
        """:meth:`put_tensor_with_parallelism`, inserting or replacing."""
        return self._parallel.put([key], [tensor], _listed(parallelism), config,
                                  _listed(writer_partition), upsert=True)[0]

    def batch_upsert_tensor_with_parallelism(self, keys: Keys, tensors_list: Sequence[Any],
                                             parallelisms: Sequence[Any] | None = None,
                                             config: Config = None,
                                             writer_partitions: Sequence[Any] | None = None
                                             ) -> list[int]:
        """:meth:`upsert_tensor_with_parallelism` for many keys."""
        return self._parallel.put(keys, tensors_list, parallelisms, config, writer_partitions,
                                  upsert=True)

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: Any = None, config: Config = None,
                                         writer_partition: Any = None) -> int:
        """:meth:`put_tensor_with_parallelism` of a tensor serialized at
        ``buffer_ptr`` (``[TensorMetadata][data]``)."""
        return self._parallel.put_from([key], [buffer_ptr], [size], _listed(parallelism),
                                       config, _listed(writer_partition), upsert=False)[0]

    def batch_put_tensor_with_parallelism_from(self, keys: Keys, buffer_ptrs: Ptrs,
                                               sizes: Sequence[int],
                                               parallelisms: Sequence[Any] | None = None,
                                               config: Config = None,
                                               writer_partitions: Sequence[Any] | None = None
                                               ) -> list[int]:
        """:meth:`put_tensor_with_parallelism_from` for many keys."""
        return self._parallel.put_from(keys, buffer_ptrs, sizes, parallelisms, config,
                                       writer_partitions, upsert=False)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: Any = None, config: Config = None,
                                            writer_partition: Any = None) -> int:
        """:meth:`put_tensor_with_parallelism_from`, inserting or replacing."""
        return self._parallel.put_from([key], [buffer_ptr], [size], _listed(parallelism),
                                       config, _listed(writer_partition), upsert=True)[0]

    def batch_upsert_tensor_with_parallelism_from(
            self, keys: Keys, buffer_ptrs: Ptrs, sizes: Sequence[int],
            parallelisms: Sequence[Any] | None = None, config: Config = None,
            writer_partitions: Sequence[Any] | None = None) -> list[int]:
        """:meth:`upsert_tensor_with_parallelism_from` for many keys."""
        return self._parallel.put_from(keys, buffer_ptrs, sizes, parallelisms, config,
                                       writer_partitions, upsert=True)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """Read through a ReadTarget: None/"as_stored": the object at ``key``;
        "shard": the shard ``target.parallelism`` names (its stored key, a
        writer-partition shard, or cut from the reconstructed full tensor);
        "full": the full tensor rebuilt from the stored TP shards (or writer
        partitions when no parallelism is given). None when unavailable."""
        return self._parallel.get([key], _listed(target))[0]

    def batch_get_tensor_with_parallelism(self, keys: Keys,
                                          targets: Sequence[Any] | None = None) -> list[Any]:
        """:meth:`get_tensor_with_parallelism` for many keys."""
        return self._parallel.get(keys, targets)

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """:meth:`get_tensor_with_parallelism`, the result serialized into
        ``[buffer_ptr, +size)`` and returned as a tensor viewing it."""
        return self._parallel.get_into([key], [buffer_ptr], [size], _listed(target))[0]

    def batch_get_tensor_with_parallelism_into(self, keys: Keys, buffer_ptrs: Ptrs,
                                               sizes: Sequence[int],
                                               targets: Sequence[Any] | None = None
                                               ) -> list[Any]:
        """:meth:`get_tensor_with_parallelism_into` for many keys."""
        return self._parallel.get_into(keys, buffer_ptrs, sizes, targets)

    # ------------------------------------------------------------------ segments, replicas, tasks

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict[str, Any]:
        """Mooncake mounts an arbitrary file or shm region; kvpool's segments are
        its own: ``{"ret": NOT_SUPPORTED (-1012), "segment_ids": []}``."""
        return {"ret": not_supported("mount_segment"), "segment_ids": []}

    def unmount_segment(self, segment_ids: Keys, grace_period_seconds: int = 0) -> int:
        """Counterpart of :meth:`mount_segment`: NOT_SUPPORTED."""
        return not_supported("unmount_segment")

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict[str, Any]:
        """Mooncake adds a memory segment to a running client; a kvpool client
        contributes one segment sized at setup: NOT_SUPPORTED."""
        return {"ret": not_supported("allocate_and_mount_segment"), "segment_ids": [],
                "allocated_size": 0}

    def unmount_and_free_segment(self, segment_ids: Keys, grace_period_seconds: int = 0) -> int:
        """Counterpart of :meth:`allocate_and_mount_segment`: NOT_SUPPORTED."""
        return not_supported("unmount_and_free_segment")

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """Mooncake detaches the client's local SSD segment; a kvpool SSD tier
        stays mounted for its owner's lifetime: NOT_SUPPORTED."""
        return not_supported("unmount_local_disk_segment")

    def get_offload_rpc_read_count(self) -> int:
        """Mooncake counts reads served by its offload RPC; kvpool reads disk
        replicas through the transfer engine: 0."""
        return 0

    def _get_pyclient_capsule(self) -> Any:
        """Mooncake-internal handle of the C++ client; here the kvpool Client
        (None when not set up)."""
        return self._core.client

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The complete replicas of ``key``, nearest first ([] when missing)."""
        return self._admin.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Keys) -> dict[str, list[ReplicaDescriptor]]:
        """``{key: replicas}`` for the keys that exist (one master RPC)."""
        return self._admin.batch_get_replica_desc(keys)

    def batch_replica_clear(self, keys: Keys, segment_name: str = "") -> list[str]:
        """Clear the replicas of ``keys`` on segment ``segment_name`` ("": every
        replica; a key's last replica going takes the object). Only keys this
        store wrote whose read lease has ended; returns the keys cleared."""
        return self._admin.batch_replica_clear(keys, segment_name)

    def create_copy_task(self, key: str, targets: Keys) -> tuple[tuple[int, int], int]:
        """Copy ``key``'s object onto each segment named in ``targets``:
        ``(task_id, 0)``, or ``((0, 0), code)`` (-704 missing key, -600 no or
        unknown target, -200 no room, -708 a task copies it already)."""
        return self._admin.create_copy_task(key, targets)

    def create_move_task(self, key: str, source: str,
                         target: str) -> tuple[tuple[int, int], int]:
        """Move ``key``'s replica from segment ``source`` to ``target``: as
        :meth:`create_copy_task`; -600 also when ``source`` holds no replica or
        equals ``target``."""
        return self._admin.create_move_task(key, source, target)

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        """``(response, 0)`` or ``(None, code)``: -1400 for an unknown id."""
        return self._admin.query_task(task_id)
