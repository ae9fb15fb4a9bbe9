"""Mooncake-compatible API: ``kvpool.store.mooncake`` stands in for ``mooncake.store``.

Every method of Mooncake's ``MooncakeDistributedStore`` (0.3.12 and 0.3.13 /
main) and every module-level name of ``mooncake.store`` exists here with
Mooncake's signature, argument names, defaults and return conventions, so
code written for Mooncake runs on kvpool by changing its import::

    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from kvpool.store.mooncake import MooncakeDistributedStore, ReplicateConfig

Conventions (Mooncake's): ``0`` or a count on success, a negative
``ErrorCode`` integer on failure, ``b""``/``None`` for a missing object; no
method raises for a store error (a wrong argument *type* raises
``TypeError``). The class is assembled from one mixin per family of calls:
:mod:`~kvpool.store.mooncake_zerocopy` (pointer, multi-buffer, range and
session calls), :mod:`~kvpool.store.mooncake_tensor` (tensor API, same
serialized layout as Mooncake's), :mod:`~kvpool.store.mooncake_admin`
(segments, replica descriptors, copy/move tasks); this module holds setup,
the bytes calls and the queries. docs/mooncake_compat.md lists every name
with what it does on kvpool.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import random
import shutil
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpool.core.auth import is_loopback
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentKind
from kvpool.store.client import Client, Location, RangeRead, parts_checksum_ok
from kvpool.store.config import (
    ClientConfig,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
    client_config_from_env,
)
from kvpool.store.errors import AlreadyExists, ObjectNotFound
from kvpool.store.mooncake_admin import AdminCalls
from kvpool.store.mooncake_core import (
    DEFAULT_TENANT,
    INVALID,
    TENANT_SEP,
    code_of,
    log,
    mooncake_code,
    mooncake_size,
)
from kvpool.store.mooncake_http import ClientHttpServer
from kvpool.store.mooncake_pool import (
    BufferLease,
    BufferLeaseView,
    BufferPool,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
)
from kvpool.store.mooncake_tensor import (
    TensorCalls,
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
from kvpool.store.mooncake_zerocopy import ZeroCopyCalls

__all__ = [
    "ACTIVATION",
    "COMPLETE",
    "FAILED",
    "GENERAL",
    "GRADIENT",
    "INITIALIZED",
    "KVCACHE",
    "METADATA",
    "OPTIMIZER_STATE",
    "PENDING",
    "PROCESSING",
    "REMOVED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "SAMPLE",
    "SUCCESS",
    "TENSOR",
    "UNDEFINED",
    "UNKNOWN",
    "WEIGHT",
    "BufferHandle",
    "BufferLease",
    "BufferLeaseView",
    "BufferPool",
    "Descriptor",
    "DiskDescriptor",
    "EngramStore",
    "EngramStoreConfig",
    "MemoryDescriptor",
    "MooncakeDistributedNoFRegister",
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ObjectDataType",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "RegisteredBufferPool",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "_deserialize_tensor",
    "_get_pyclient_from_wrapper",
    "_serialize_tensor",
    "_tensor_metadata_size",
    "bind_to_numa_node",
    "get_alloc_func_addr",
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

_DEFAULT_SEGMENT = 16 * 1024 * 1024
DEFAULT_CLIENT_HTTP_PORT = 9300
HC_HEALTHY, HC_NOT_INITIALIZED, HC_MASTER_UNREACHABLE = 0, 1, 2

# Mooncake's transport names kvpool has no equivalent for: accepted, and
# cross-host transfers use tcp (one warning per setup)
_FOREIGN_PROTOCOLS = ("efa", "cxl", "nvlink", "nvlink_intra", "ascend", "hip", "ubshmem",
                      "barex", "nvmeof", "hccl")
# Mooncake picks its transfer port in this range unless the hostname names one
_PORT_RANGE_ENV = ("MC_STORE_CLIENT_MIN_PORT", "MC_STORE_CLIENT_MAX_PORT")
_PORT_RANGE = (12300, 14300)
_PORT_TRIES = 20
# SSD offload (Mooncake's environment variables)
_OFFLOAD_PATH_ENV = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"
_OFFLOAD_SIZE_ENV = "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"
_OFFLOAD_DEFAULT_MAX = 64 << 30  # preallocated: a quarter of the free space, at most this


def _split_host(local_hostname: str) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` too) -> (host, port or 0)."""
    text = str(local_hostname).strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else 0
    if text.count(":") == 1:
        host, port = text.rsplit(":", 1)
        if port.isdigit():
            return host, int(port)
    return text, 0


def _bind_address(host: str, master: str) -> str:
    """Where to bind the transfer server for Mooncake's ``local_hostname``: its
    address; a name that resolves to loopback while the master is remote gets
    this host's address towards the master (peers must reach it)."""
    if host in ("", "localhost"):
        return "127.0.0.1"
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = ""
    if addr and (not is_loopback(addr) or is_loopback(master)):
        return addr
    from kvpool.store.config import local_address_towards

    return local_address_towards(master) if not is_loopback(master) else "127.0.0.1"


def _transport_rules(protocol: str) -> list[dict[str, Any]]:
    """Selector rules for Mooncake's ``protocol``: same host always shm first;
    cross-host memory through ``rdma`` (then tcp) or ``tcp`` only."""
    from kvpool.transfer.config import DEFAULT_RULES

    remote = ["rdma", "tcp"] if protocol == "rdma" else ["tcp"]
    rules = []
    for rule in DEFAULT_RULES:
        r = dict(rule)
        if r.get("kind") == "memory" and r.get("same_host") is False:
            r["transports"] = remote
        rules.append(r)
    return rules


def _free_port(bind_host: str) -> int:
    """A free TCP port on ``bind_host`` in Mooncake's client range."""
    lo, hi = _PORT_RANGE
    try:
        lo = int(os.environ.get(_PORT_RANGE_ENV[0], lo))
        hi = int(os.environ.get(_PORT_RANGE_ENV[1], hi))
    except ValueError:
        lo, hi = _PORT_RANGE
    if not 0 < lo <= hi < 65536:
        lo, hi = _PORT_RANGE
    for _ in range(64):
        port = random.randint(lo, hi)
        with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
            try:
                s.bind((bind_host, port))
                return port
            except OSError:
                continue
    return 0  # the range is full: any free port


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _part_view(obj: Any) -> memoryview:
    """A part of put_parts/upsert_parts: a 1-D bytes-like object (Mooncake's rule)."""
    mv = memoryview(obj)
    if mv.ndim != 1 or mv.itemsize != 1:
        raise RuntimeError("parts must be 1-D bytes-like")
    return mv


def _slot_free(directory: Path) -> bool:
    """Whether no live process holds the SSD-tier segment file in ``directory``."""
    path = directory / "kvpool-segment.kvseg"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _offload_dir(base: str) -> Path:
    """This process's SSD-tier directory under ``base``: the first ``slot-N``
    whose segment file is not held by a live process (a restart reuses its
    slot's file, so its disk objects come back)."""
    root = Path(base)
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1024):
        slot = root / f"slot-{n}"
        if _slot_free(slot):
            slot.mkdir(exist_ok=True)
            return slot
    raise KVPoolError(f"{base}: every SSD-offload slot is in use", ErrorCode.INVALID_PARAMS)


def _offload_size(directory: Path, configured: int) -> int:
    """Bytes of this process's SSD tier: Mooncake's size limit variable, else
    the KVPOOL_CONFIG disk_size, else a quarter of the free space (at most
    64 GiB; it is preallocated)."""
    env = os.environ.get(_OFFLOAD_SIZE_ENV, "").strip()
    if env:
        return mooncake_size(env)
    if configured > 0:
        return configured
    free = shutil.disk_usage(directory).free
    size = min(_OFFLOAD_DEFAULT_MAX, free // 4) & ~((1 << 20) - 1)
    log.info("SSD offload: %d MiB preallocated under %s (set %s to change)",
             size >> 20, directory, _OFFLOAD_SIZE_ENV)
    return size


class MooncakeDistributedStore(ZeroCopyCalls, TensorCalls, AdminCalls):
    """Drop-in for ``mooncake.store.MooncakeDistributedStore`` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._http: ClientHttpServer | None = None

    # ------------------------------------------------------------------ lifecycle

    def setup(
        self,
        local_hostname: str | Mapping[str, Any] | None = None,
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = _DEFAULT_SEGMENT,
        local_buffer_size: int = _DEFAULT_SEGMENT,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = DEFAULT_TENANT,
        enable_client_http_server: bool = False,
        client_http_port: int = DEFAULT_CLIENT_HTTP_PORT,
        *,
        config: Mapping[str, Any] | None = None,
    ) -> int:
        """Connect to the master at ``master_server_addr``, contribute
        ``global_segment_size`` bytes of memory and start this store's transfer
        server on ``local_hostname`` (``host`` or ``host:port``). Also
        ``setup(config_dict)`` with the same keys as strings or values.

        ``enable_ssd_offload``: this store gets an SSD tier under
        ``ssd_offload_path`` (or ``$MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``), or,
        without a path, the disk tier of a node daemon on this host serves it;
        neither is an error. ``tenant_id`` namespaces every key.
        ``metadata_server``, ``rdma_devices`` and ``engine`` are accepted and
        not needed. Returns 0 or a negative code.
        """
        if config is not None:
            return self._setup_dict(config)
        if isinstance(local_hostname, Mapping):
            return self._setup_dict(local_hostname)
        if local_hostname is None:
            raise TypeError("setup() needs local_hostname (or a config dict)")
        try:
            extra: dict[str, Any] = {}
            return self._setup(str(local_hostname), str(metadata_server),
                               mooncake_size(global_segment_size),
                               mooncake_size(local_buffer_size), str(protocol),
                               str(rdma_devices), str(master_server_addr), engine,
                               _as_bool(enable_ssd_offload), str(ssd_offload_path or ""),
                               str(tenant_id), _as_bool(enable_client_http_server),
                               int(client_http_port), extra)
        except KVPoolError as exc:
            log.error("setup failed: %s", exc)
            return code_of(exc)
        except Exception as exc:  # e.g. the transfer port is taken: a code, never a raise
            log.error("setup failed: %r", exc)
            return int(ErrorCode.INTERNAL_ERROR)

    def _setup_dict(self, config: Mapping[str, Any]) -> int:
        d = dict(config)
        host, meta = d.pop("local_hostname", None), d.pop("metadata_server", None)
        if not host or not meta:
            log.error("setup(config): local_hostname and metadata_server are required")
            return INVALID
        master = d.pop("master_server_addr", None) or d.pop("master_server_address", None) \
            or "127.0.0.1:50051"
        d.pop("master_server_address", None)
        devices = d.pop("rdma_devices", None) or d.pop("device_name", None) or ""
        d.pop("device_name", None)
        d.pop("ipc_socket_path", None)
        known = {
            "global_segment_size": _DEFAULT_SEGMENT, "local_buffer_size": _DEFAULT_SEGMENT,
            "protocol": "tcp", "enable_ssd_offload": False, "ssd_offload_path": "",
            "tenant_id": DEFAULT_TENANT, "enable_client_http_server": False,
            "client_http_port": DEFAULT_CLIENT_HTTP_PORT,
        }
        args = {k: d.pop(k, v) for k, v in known.items()}
        extra = {k: v for k, v in d.items() if k in ClientConfig.__dataclass_fields__}
        ignored = sorted(set(d) - set(extra))
        if ignored:
            log.info("setup(config): keys %s are not used by kvpool", ignored)
        try:
            return self._setup(str(host), str(meta), mooncake_size(args["global_segment_size"]),
                               mooncake_size(args["local_buffer_size"]), str(args["protocol"]),
                               str(devices), str(master), None,
                               _as_bool(args["enable_ssd_offload"]),
                               str(args["ssd_offload_path"] or ""), str(args["tenant_id"]),
                               _as_bool(args["enable_client_http_server"]),
                               int(args["client_http_port"]), extra)
        except (KVPoolError, ValueError) as exc:
            log.error("setup(config) failed: %s", exc)
            return code_of(exc) if isinstance(exc, KVPoolError) else INVALID
        except Exception as exc:  # never raise for a failed setup (Mooncake returns a code)
            log.error("setup(config) failed: %r", exc)
            return int(ErrorCode.INTERNAL_ERROR)

    def _setup(self, local_hostname: str, metadata_server: str, global_segment_size: int,
               local_buffer_size: int, protocol: str, rdma_devices: str, master: str,
               engine: Any, enable_ssd_offload: bool, ssd_offload_path: str, tenant_id: str,
               enable_client_http_server: bool, client_http_port: int,
               extra: dict[str, Any]) -> int:
        if self._client is not None:
            log.warning("setup() on a store that is set up: closing the previous client")
            self.close()
        host, port = _split_host(local_hostname)
        if not host:
            log.error("local_hostname is empty")
            return INVALID
        protocol = protocol.lower()
        if protocol in _FOREIGN_PROTOCOLS:
            log.warning("protocol %r has no kvpool equivalent: cross-host transfers use tcp, "
                        "same-host ones shared memory", protocol)
            protocol = "tcp"
        elif protocol not in ("tcp", "rdma"):
            log.error("unknown protocol %r (tcp or rdma)", protocol)
            return int(ErrorCode.INTERNAL_ERROR)
        if rdma_devices and rdma_devices != "auto-discovery":
            log.info("rdma_devices %r accepted: kvpool's rdma transport picks its device",
                     rdma_devices)
        if engine is not None:
            log.info("engine accepted and not used: kvpool runs its own transfer engine")
        del metadata_server  # the kvpool master serves segment metadata itself
        self._set_tenant(tenant_id)
        self._local_buffer_size = local_buffer_size
        bind = str(extra.pop("bind_host", "")) or _bind_address(host, master)
        overrides: dict[str, Any] = {
            "master_address": master,
            "memory_size": global_segment_size,
            # the machine's identity (as the node daemon's): same-host peers use
            # shared memory whatever local_hostname says; KVPOOL_CONFIG or the
            # dict form may set it
            "host_id": extra.pop("host_id", None),
            "bind_host": bind,
            "transfer_overrides": {"rules": _transport_rules(protocol)},
            **extra,
        }
        disk_wanted = enable_ssd_offload and bool(
            ssd_offload_path or os.environ.get(_OFFLOAD_PATH_ENV, ""))
        base_cfg = client_config_from_env(overrides)
        if disk_wanted:
            slot = _offload_dir(ssd_offload_path or os.environ[_OFFLOAD_PATH_ENV])
            base_cfg.disk_dir = str(slot)
            base_cfg.disk_size = _offload_size(slot, base_cfg.disk_size)
        client = self._start_client(base_cfg, host, port)
        if enable_ssd_offload and not disk_wanted and not self._node_has_disk(client):
            client.close()
            log.error("enable_ssd_offload: no ssd_offload_path (or %s) and no disk tier on "
                      "this host; start `kvpool client --disk-dir DIR --disk SIZE` here or "
                      "pass a path", _OFFLOAD_PATH_ENV)
            return INVALID
        self._client = client
        self._hostname = client.segment_ids[0] if client.segment_ids else \
            f"{host}:{client.endpoint.rsplit(':', 1)[-1]}"
        if enable_client_http_server:
            try:
                self._http = ClientHttpServer(self, bind, client_http_port)
            except OSError as exc:
                log.error("client HTTP server on port %d: %s", client_http_port, exc)
                self.close()
                return INVALID
        return 0

    def _start_client(self, cfg: ClientConfig, host: str, port: int) -> Client:
        """Set up a Client on ``port``, or on a free port in Mooncake's range
        (retried when another process takes it first); its segment is named
        ``host:port`` (Mooncake's hostname). Raises KVPoolError."""
        last: KVPoolError | None = None
        for _ in range(1 if port or cfg.transfer_port else _PORT_TRIES):
            p = port or cfg.transfer_port or _free_port(cfg.bind_host)
            seg = cfg.segment_id or (f"{host}:{p}" if p else None)
            client = Client(dataclasses.replace(cfg, transfer_port=p, segment_id=seg))
            try:
                client.setup()
                return client
            except KVPoolError as exc:
                last = exc
                if "Address already in use" not in str(exc):
                    raise
        assert last is not None
        raise last

    def _node_has_disk(self, client: Client) -> bool:
        """Whether a disk-tier (FILE) segment of this host is in the pool."""
        try:
            segments = client.list_segments()
        except KVPoolError:
            return False
        bind = client.config.bind_host
        for info in segments:
            seg = info.descriptor
            if seg.kind != SegmentKind.FILE:
                continue
            peer = seg.endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
            if seg.host_id == client.host_id or peer == bind or (
                    is_loopback(peer) and is_loopback(bind)):
                return True
        return False

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str) -> int:
        """Standalone mode: a thin client in the engine process, the memory
        (and disk) held by the node daemon on this host (``kvpool client``).

        Connects to the master named by ``$KVPOOL_CONFIG`` (``master_address``)
        when set, else to ``server_address``; contributes nothing. Returns -1
        when no node daemon on this host contributes memory (Mooncake: the
        local client is not reachable). ``mem_pool_size`` is accepted: the
        engine's buffers need no pre-mapping on kvpool.
        """
        if self._client is not None:
            self.close()
        try:
            env_has_master = bool(os.environ.get("KVPOOL_CONFIG"))
            overrides: dict[str, Any] = {"memory_size": 0}
            if not env_has_master:
                overrides["master_address"] = str(server_address)
            cfg = client_config_from_env(overrides)
            client = Client(cfg)
            client.setup()
        except Exception as exc:
            log.error("setup_dummy: %r", exc)
            return int(ErrorCode.INTERNAL_ERROR)
        if not self._node_has_memory(client):
            client.close()
            log.error("setup_dummy: no node daemon on this host contributes memory "
                      "(start `kvpool client --master %s --memory SIZE` here)",
                      cfg.master_address)
            return int(ErrorCode.INTERNAL_ERROR)
        del mem_pool_size
        self._local_buffer_size = mooncake_size(local_buffer_size)
        self._set_tenant(DEFAULT_TENANT)
        self._client = client
        self._hostname = f"{client.host_id}:{client.endpoint.rsplit(':', 1)[-1]}"
        return 0

    def _node_has_memory(self, client: Client) -> bool:
        try:
            segments = client.list_segments()
        except KVPoolError:
            return False
        return any(s.descriptor.kind == SegmentKind.MEMORY
                   and s.descriptor.host_id == client.host_id for s in segments)

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = _DEFAULT_SEGMENT) -> int:
        """Mooncake's older one-call init: sets up on ``localhost`` with the
        default master (127.0.0.1:50051); INVALID_PARAMS once set up."""
        if self._client is not None:
            log.error("init_all: the client is already initialized")
            return INVALID
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, 1 << 30,
                          protocol, device_name, "127.0.0.1:50051")

    def close(self) -> int:
        """Unmount this store's memory segment and release everything; its
        objects leave the pool (its SSD tier stays for a restart). Idempotent;
        the store can be set up again afterwards. Returns 0."""
        http, self._http = self._http, None
        if http is not None:
            http.close()
        client, self._client = self._client, None
        self._end_sessions()
        self._forget_registrations()
        if client is not None:
            client.close()
        self._hostname = ""
        return 0

    def __del__(self) -> None:
        # a store dropped without close() unmounts like Mooncake's destructor
        try:
            if getattr(self, "_client", None) is not None:
                self.close()
        except Exception:  # interpreter shutdown: best effort only
            pass

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        client = self._client
        if client is None:
            return HC_NOT_INITIALIZED
        try:
            client.stats()
            return HC_HEALTHY
        except KVPoolError:
            return HC_MASTER_UNREACHABLE

    def get_hostname(self) -> str:
        """``host:port`` naming this store's segment (Mooncake's format; usable
        as ``ReplicateConfig.preferred_segment``); "" when not set up."""
        return self._hostname

    # ------------------------------------------------------------------ bytes

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like). 0 on success and when the key exists
        (its value is kept), else a negative code (INVALID_PARAMS for an empty
        key or value, or a value larger than ``local_buffer_size``)."""
        try:
            view = memoryview(value)
            if view.nbytes == 0 or not self._fits_staging(view.nbytes):
                return INVALID
            self._c().put(self._k(key), view, self._config(config))
            return 0
        except AlreadyExists:
            return 0
        except KVPoolError as exc:
            return code_of(exc)

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` when missing, unreadable or larger than
        ``local_buffer_size``."""
        k = self._k_or_none(key)
        if k is None or self._client is None:
            return b""
        try:
            value = self._client.get(k)
        except ObjectNotFound:
            return b""
        except KVPoolError as exc:
            log.debug("get %r: %s", key, exc)
            return b""
        return value if self._fits_staging(len(value)) else b""

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """Put many values; 0 when every key is stored (or existed), else the
        first negative code."""
        if len(keys) != len(values):
            return INVALID
        try:
            views = [memoryview(v) for v in values]
            if not self._fits_staging(sum(v.nbytes for v in views)):
                return INVALID
            codes = self._c().put_batch(self._ks(keys), views, self._config(config, len(keys)))
        except KVPoolError as exc:
            return code_of(exc)
        for c in codes:
            if c not in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS):
                return mooncake_code(c)
        return 0

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Values in key order, ``b""`` where missing. (Mooncake answers ``[b""]``
        for an empty key list; kvpool answers ``[]``.)"""
        handles = self.batch_get_buffer(keys)
        return [bytes(h) if h is not None else b"" for h in handles]

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like objects) as one
        object, without joining them first. Codes as :meth:`put`."""
        views = [_part_view(p) for p in parts]
        return self._put_parts_many([key], [views], config)[0]

    def _put_parts_many(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                        config: ReplicateConfig | None) -> list[int]:
        try:
            total = sum(memoryview(p).nbytes for ps in parts for p in ps)
            if not self._fits_staging(total):
                return [INVALID] * len(keys)
            sizes = [sum(memoryview(p).nbytes for p in ps) for ps in parts]
            pool_keys = self._ks(keys)
            codes = self._c().batch_put_parts(pool_keys, parts, self._config(config, len(keys)))
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return [0 if c in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) and size
                else (INVALID if not size else mooncake_code(c))
                for c, size in zip(codes, sizes, strict=True)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value of ``key`` in a :class:`BufferHandle` (buffer protocol),
        or None when missing or unreadable."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """:meth:`get_buffer` for many keys: one master RPC, one transfer batch."""
        if self._client is None or not keys:
            return [None] * len(keys)
        valid = [(i, k) for i, k in ((i, self._k_or_none(k)) for i, k in enumerate(keys))
                 if k is not None]
        out: list[BufferHandle | None] = [None] * len(keys)
        try:
            locs = self._client.batch_locate([k for _, k in valid])
        except KVPoolError as exc:
            log.debug("batch_get_buffer: %s", exc)
            return out
        found = [(i, loc) for (i, _k), loc in zip(valid, locs, strict=True)
                 if loc.code == ErrorCode.OK]
        if not self._fits_staging(sum(loc.size for _, loc in found)):
            return out
        handles = {i: BufferHandle(loc.size) for i, loc in found}
        try:
            results = self._client.read_ranges(
                [RangeRead(loc, handles[i], 0, loc.size) for i, loc in found])
        except KVPoolError as exc:
            log.debug("batch_get_buffer: %s", exc)
            return out
        for (i, loc), n in zip(found, results, strict=True):
            if n == loc.size and self._checksum_ok(loc, handles[i]):
                out[i] = handles[i]
        return out

    def _checksum_ok(self, loc: Location, buf: Any) -> bool:
        if not loc.checksum or self._client is None or not self._client.config.verify_checksum:
            return True
        return parts_checksum_ok(loc.checksum, [buf], loc.size) is not False

    # ------------------------------------------------------------------ upsert

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Insert ``value`` under ``key`` or replace the existing value. 0 or a
        negative code (INVALID_PARAMS as :meth:`put`, and for
        ``soft_pin_ttl_ms`` without ``SoftPinAction.ENABLE``)."""
        view = memoryview(value)
        if view.nbytes == 0:
            return INVALID
        return self._upsert_many([key], [[view]], config)[0]

    def upsert_parts(self, key: str, *parts: Any,
                     config: ReplicateConfig | None = None) -> int:
        """:meth:`upsert` of the concatenation of ``parts``."""
        views = [_part_view(p) for p in parts]
        return self._upsert_many([key], [views], config)[0]

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> int:
        """:meth:`upsert` for many keys; 0 or the first negative code."""
        if len(keys) != len(values):
            return INVALID
        codes = self._upsert_many(keys, [[memoryview(v)] for v in values], config)
        return next((c for c in codes if c != 0), 0)

    # ------------------------------------------------------------------ queries, removal

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not (also for an empty key), -1 on error."""
        k = self._k_or_none(key)
        if k is None:
            return 0
        try:
            return 1 if self._c().exists(k) else 0
        except KVPoolError:
            return -1

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1/0/-1 per key in input order; [] for []."""
        if not keys:
            return []
        out = [0] * len(keys)
        valid = [(i, k) for i, k in ((i, self._k_or_none(k)) for i, k in enumerate(keys))
                 if k is not None]
        if not valid:
            return out
        try:
            found = self._c().batch_exists([k for _, k in valid])
        except KVPoolError:
            return [-1] * len(keys)
        for (i, _k), e in zip(valid, found, strict=True):
            out[i] = 1 if e else 0
        return out

    def get_size(self, key: str) -> int:
        """Size of ``key``'s value, or a negative code (-704 when missing)."""
        try:
            return self._c().get_size(self._k(key))
        except KVPoolError as exc:
            return code_of(exc)

    def remove(self, key: str, force: bool = False) -> int:
        """0 when removed; -706 OBJECT_HAS_LEASE while a read lease is held
        (unless ``force``); -704 when missing."""
        try:
            self._c().remove(self._k(key), force=force)
            return 0
        except KVPoolError as exc:
            return code_of(exc)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """:meth:`remove` for many keys in one RPC; per key 0 or a negative code."""
        try:
            return [mooncake_code(c) for c in self._c().batch_remove(self._ks(keys), force)]
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key of this store's tenant matching ``regex_pattern``
        (``re.search`` on the key; unleased ones, or all with ``force``): the
        count, or a negative code (-600 for a bad pattern). One master RPC."""
        return self._remove_where(str(regex_pattern), force)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object of this store's tenant (unleased ones, or all
        with ``force``): the count, or a negative code. One master RPC."""
        return self._remove_where("", force)

    def _remove_where(self, pattern: str, force: bool) -> int:
        # the default tenant's keys are the ones without a tenant prefix
        exclude = "" if self._prefix else TENANT_SEP
        try:
            return self._c().remove_by_regex(pattern, force, self._prefix, exclude)
        except KVPoolError as exc:
            return code_of(exc)


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
    return wrapper._client

