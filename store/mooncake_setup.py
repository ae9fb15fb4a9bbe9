"""Setting up and closing a Mooncake-compatible store: ``setup``, ``setup_dummy``, ``close``.

``setup`` reads Mooncake's arguments (positional, or a config dict with
Mooncake's keys and units) and starts a kvpool
:class:`~kvpool.store.client.Client`: its transfer server on
``local_hostname`` (a free port in Mooncake's client range unless one is
named), ``global_segment_size`` bytes of memory, the cross-host transport
``protocol`` names (same-host transfers use shared memory whatever it says),
an SSD tier when ``enable_ssd_offload`` asks for one, the client's tenant
(``tenant_id``: the master keeps each tenant's keys apart) and the client
HTTP endpoints. ``setup_dummy`` is Mooncake's standalone
mode: a pure client beside the node daemon of this host, which it finds at
the address Mooncake code passes (the daemon's standalone port,
:mod:`kvpool.store.daemon`). A setup that fails returns a Mooncake code and
never raises.
"""

from __future__ import annotations

import dataclasses
import fcntl
import http.client
import os
import random
import shutil
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvpool.core.auth import is_loopback
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.protocol import SegmentKind
from kvpool.core.tenants import DEFAULT_TENANT, tenant_name
from kvpool.store.client import Client
from kvpool.store.config import (
    CONFIG_ENV,
    DEFAULT_DUMMY_PORT,
    ClientConfig,
    client_config_from_env,
)
from kvpool.store.daemon import STANDALONE_PATH, StandaloneInfo
from kvpool.store.mooncake_codes import INTERNAL, INVALID, code_of, log
from kvpool.store.mooncake_core import MooncakeCore, mooncake_size
from kvpool.store.mooncake_http import ClientHttpServer
from kvpool.store.mooncake_memory import CallerMemory
from kvpool.store.mooncake_session import SessionCalls
from kvpool.store.mooncake_types import MooncakeHostMemAllocator

__all__ = ["DEFAULT_CLIENT_HTTP_PORT", "DEFAULT_SEGMENT", "Lifecycle"]

DEFAULT_SEGMENT = 16 * 1024 * 1024
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
#: explicit transfer ports (local_hostname's) held by live stores of this process
_PORTS_HERE: set[int] = set()
_NODE_TIMEOUT_S = 3.0  # the node daemon's standalone port answers from memory


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


def _ask_node(address: str) -> tuple[StandaloneInfo | None, str]:
    """Ask the node daemon's standalone port at ``address`` (``host:port``)
    who it is: ``(info, "")``, or ``(None, why)`` when nothing (or something
    else) answers there."""
    host, port = _split_host(address.split("://", 1)[-1])
    if not port:
        return None, "no port in the address"
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}{STANDALONE_PATH}"
    try:
        # no proxy: the daemon is on this host, whatever $http_proxy says
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=_NODE_TIMEOUT_S) as reply:
            return msgspec.json.decode(reply.read(), type=StandaloneInfo), ""
    except urllib.error.HTTPError as exc:  # 503: its segments are not mounted yet
        return None, f"the node daemon answered {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        return None, str(exc.reason)
    except (OSError, msgspec.DecodeError, http.client.HTTPException) as exc:
        return None, f"not a kvpool node daemon ({exc!r})"


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


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


class Lifecycle:
    """Setup, standalone setup, health and close of one store (module docstring)."""

    def __init__(self, core: MooncakeCore, memory: CallerMemory,
                 sessions: SessionCalls) -> None:
        self._core = core
        self._memory = memory
        self._sessions = sessions
        self._http: ClientHttpServer | None = None
        self._node = ""  # standalone mode: the node daemon's address (setup_dummy)
        self._standalone = False
        self._port = 0  # the explicit port of local_hostname this store holds
        # standalone mode: alloc_from_mem_pool's mappings and the bytes left of mem_pool_size
        self._pool = MooncakeHostMemAllocator()
        self._pool_ptrs: list[int] = []
        self._pool_left = 0

    def setup(self, local_hostname: str | Mapping[str, Any] | None, metadata_server: str,
              global_segment_size: int | str, local_buffer_size: int | str, protocol: str,
              rdma_devices: str, master_server_addr: str, engine: Any,
              enable_ssd_offload: bool, ssd_offload_path: str, tenant_id: str,
              enable_client_http_server: bool, client_http_port: int,
              config: Mapping[str, Any] | None) -> int:
        """Mooncake's ``setup`` (positional or dict form): 0 or a Mooncake code."""
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
            return INTERNAL

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
            "global_segment_size": DEFAULT_SEGMENT, "local_buffer_size": DEFAULT_SEGMENT,
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
            return INTERNAL

    def _setup(self, local_hostname: str, metadata_server: str, global_segment_size: int,
               local_buffer_size: int, protocol: str, rdma_devices: str, master: str,
               engine: Any, enable_ssd_offload: bool, ssd_offload_path: str, tenant_id: str,
               enable_client_http_server: bool, client_http_port: int,
               extra: dict[str, Any]) -> int:
        if self._core.client is not None:
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
            return INTERNAL
        if rdma_devices and rdma_devices != "auto-discovery":
            log.info("rdma_devices %r accepted: kvpool's rdma transport picks its device",
                     rdma_devices)
        if engine is not None:
            log.info("engine accepted and not used: kvpool runs its own transfer engine")
        del metadata_server  # the kvpool master serves segment metadata itself
        # The master scopes every request by the client's tenant; tenant t's key
        # k is stored as "\x1ft\x1fk", the bytes this class prefixed on the
        # client side before, so what a store wrote under tenant_id t then
        # stays readable by a store with tenant_id t now.
        tenant = tenant_name(tenant_id.strip())
        self._core.local_buffer_size = local_buffer_size
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
        if tenant != DEFAULT_TENANT:  # else KVPOOL_CONFIG's (or the dict's) tenant, if any
            overrides["tenant"] = tenant
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
        self._core.client = client
        self._core.hostname = client.segment_ids[0] if client.segment_ids else \
            f"{host}:{client.endpoint.rsplit(':', 1)[-1]}"
        if enable_client_http_server:
            try:
                self._http = ClientHttpServer(self._core, self.health_check, bind,
                                              client_http_port)
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
        if port and port in _PORTS_HERE:
            # Mooncake lets two stores of a process name the same host:port;
            # kvpool's transfer servers cannot share one: this store takes a
            # free port (and its segment that name)
            log.warning("%s:%d is taken by another store of this process: this one takes "
                        "another port (get_hostname() says which)", host, port)
            port = 0
        for _ in range(1 if port or cfg.transfer_port else _PORT_TRIES):
            p = port or cfg.transfer_port or _free_port(cfg.bind_host)
            seg = cfg.segment_id or (f"{host}:{p}" if p else None)
            client = Client(dataclasses.replace(cfg, transfer_port=p, segment_id=seg))
            try:
                client.setup()
                if port:
                    _PORTS_HERE.add(port)
                    self._port = port
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
        (and disk) held by the node daemon on this host (``kvpool client``,
        Mooncake's ``mooncake_client``).

        ``server_address`` is the daemon's standalone port
        (``127.0.0.1:50052`` unless it was started with ``--dummy-port``):
        the daemon answers with its master, tenant, host id and memory
        segment, and this store connects to that master as a pure client
        (contributes nothing; ``get_hostname()`` is the daemon's segment).
        When nothing answers there and ``$KVPOOL_CONFIG`` is set, the master
        it names is used and a daemon of this host must contribute memory.
        Returns 0, or -1 (Mooncake: the local client is not reachable) after
        one log line saying what to start. ``mem_pool_size`` bounds what
        :meth:`alloc_from_mem_pool` hands out.
        """
        if self._core.client is not None:
            self.close()
        try:
            pool_size, buffer_size = mooncake_size(mem_pool_size), mooncake_size(local_buffer_size)
        except (KVPoolError, ValueError, TypeError) as exc:
            log.error("setup_dummy: %s", exc)
            return INVALID
        node, why = _ask_node(str(server_address))
        overrides: dict[str, Any] = {"memory_size": 0}
        if node is not None:
            overrides.update(master_address=node.master, tenant=node.tenant,
                             host_id=node.host_id)
            if not node.memory_size:
                log.warning("setup_dummy: the node daemon at %s contributes no memory (start "
                            "it with --memory SIZE): puts go to other nodes' memory only",
                            server_address)
        elif not os.environ.get(CONFIG_ENV):
            log.error("setup_dummy: no kvpool node daemon answers at %s (%s): start `kvpool "
                      "client --master MASTER --memory SIZE` on this host (it answers "
                      "standalone clients on 127.0.0.1:%d, or --dummy-port PORT)",
                      server_address, why, DEFAULT_DUMMY_PORT)
            return INTERNAL
        try:
            cfg = client_config_from_env(overrides)
            client = Client(cfg)
            client.setup()
        except Exception as exc:
            log.error("setup_dummy: %r", exc)
            return INTERNAL
        if node is None and not self._node_has_memory(client):
            client.close()
            log.error("setup_dummy: no node daemon on this host contributes memory "
                      "(start `kvpool client --master %s --memory SIZE` here)",
                      cfg.master_address)
            return INTERNAL
        self._core.local_buffer_size = buffer_size
        self._core.client = client
        self._node = str(server_address) if node is not None else ""
        self._standalone = True
        self._pool_left = max(0, pool_size)
        self._core.hostname = node.segment_id if node is not None and node.segment_id else \
            f"{client.host_id}:{client.endpoint.rsplit(':', 1)[-1]}"
        return 0

    def _node_has_memory(self, client: Client) -> bool:
        try:
            segments = client.list_segments()
        except KVPoolError:
            return False
        return any(s.descriptor.kind == SegmentKind.MEMORY
                   and s.descriptor.host_id == client.host_id for s in segments)

    def alloc_from_mem_pool(self, size: int) -> int:
        """Standalone mode: ``size`` bytes of page-aligned host memory for the
        zero-copy calls (Mooncake: a new shared-memory region the local client
        maps), at most ``mem_pool_size`` in all, freed at :meth:`close`; 0 when
        the pool is spent. 0 for a store set up with ``setup`` (as Mooncake's
        real client)."""
        size = int(size)
        if not self._standalone or size <= 0 or size > self._pool_left:
            if self._standalone and size > self._pool_left:
                log.error("alloc_from_mem_pool(%d): %d bytes of mem_pool_size left", size,
                          self._pool_left)
            return 0
        ptr = self._pool.alloc(size)
        if ptr:
            self._pool_ptrs.append(ptr)
            self._pool_left -= size
        return ptr

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = DEFAULT_SEGMENT) -> int:
        """Mooncake's older one-call init: sets up on ``localhost`` with the
        default master (127.0.0.1:50051); INVALID_PARAMS once set up."""
        if self._core.client is not None:
            log.error("init_all: the client is already initialized")
            return INVALID
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, 1 << 30, protocol,
                          device_name, "127.0.0.1:50051", None, False, "", DEFAULT_TENANT,
                          False, DEFAULT_CLIENT_HTTP_PORT, None)

    def close(self) -> int:
        """Unmount this store's memory segment and release everything; its
        objects leave the pool (its SSD tier stays for a restart). Idempotent;
        the store can be set up again afterwards. Returns 0."""
        http, self._http = self._http, None
        if http is not None:
            http.close()
        client, self._core.client = self._core.client, None
        self._sessions.end_all()
        self._memory.forget()
        if client is not None:
            client.close()
        self._core.hostname = ""
        self._node = ""
        self._standalone = False
        _PORTS_HERE.discard(self._port)
        self._port = 0
        for ptr in self._pool_ptrs:
            self._pool.free(ptr)
        self._pool_ptrs.clear()
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        client = self._core.client
        if client is None:
            return HC_NOT_INITIALIZED
        if self._node and _ask_node(self._node)[0] is None:
            return HC_MASTER_UNREACHABLE  # standalone: the node daemon holding the memory is gone
        try:
            client.stats()
            return HC_HEALTHY
        except KVPoolError:
            return HC_MASTER_UNREACHABLE
