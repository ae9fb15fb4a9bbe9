"""Mooncake-compatible API: :class:`MooncakeDistributedStore` over :class:`Client`.

Same method names, positional arguments, defaults and integer return codes as
Mooncake 0.3.x's Python ``mooncake.store.MooncakeDistributedStore``, so code
written for it (vLLM's / LMCache's / SGLang's Mooncake integrations) runs on
kvpool by changing its import. Return conventions:

- ``0`` success, a negative :class:`ErrorCode` value on failure (never raises
  for store errors; a wrong argument *type* still raises ``TypeError``);
- ``get`` returns ``b""`` when the key is missing or unreadable;
- ``get_into``/``batch_get_into`` return bytes read or a negative code;
- ``is_exist`` returns 1 / 0 / -1 (error).

``metadata_server`` is accepted and unused (the kvpool master serves segment
metadata). ``protocol`` ("tcp" or "rdma") names the cross-host transport;
processes on the same host always use shared memory. See
docs/mooncake_compat.md for the covered subset.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store._gpuptr import pointer_is_device
from kvpool.store.client import Client
from kvpool.store.config import ClientConfig, ReplicateConfig
from kvpool.store.errors import AlreadyExists, ObjectNotFound

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]

log = logging.getLogger(__name__)

_DEFAULT_SEGMENT = 16 * 1024 * 1024
_INVALID = int(ErrorCode.INVALID_PARAMS)


def _code(exc: BaseException) -> int:
    if isinstance(exc, KVPoolError):
        return int(exc.code)
    return int(ErrorCode.INTERNAL_ERROR)


def _bind_address(local_hostname: str) -> str:
    """Where to bind the transfer server for Mooncake's ``local_hostname``."""
    host = local_hostname.rsplit(":", 1)[0] if local_hostname.count(":") == 1 else local_hostname
    if host in ("", "localhost"):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


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


class MooncakeDistributedStore:
    """Drop-in for ``mooncake.store.MooncakeDistributedStore`` (see module docstring)."""

    def __init__(self) -> None:
        self._client: Client | None = None
        self._hostname = ""
        # registered regions: sorted start addresses -> (end, handle)
        self._reg_starts: list[int] = []
        self._reg: dict[int, tuple[int, Any]] = {}
        self._reg_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def setup(
        self,
        local_hostname: str | Mapping[str, Any],
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_size: int = _DEFAULT_SEGMENT,
        local_buffer_size: int = _DEFAULT_SEGMENT,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
    ) -> int:
        """Connect to the master at ``master_server_addr`` and contribute
        ``global_segment_size`` bytes. Also ``setup(config_dict)`` with the same
        keys (``master_server_address``/``device_name`` spellings accepted).
        ``local_buffer_size`` is accepted and unused: kvpool reads and writes
        caller memory directly. Returns 0, or a negative code."""
        if isinstance(local_hostname, Mapping):
            d = dict(local_hostname)
            local_hostname = str(d.get("local_hostname", "localhost"))
            global_segment_size = d.get("global_segment_size", global_segment_size)
            protocol = str(d.get("protocol", protocol))
            master_server_addr = str(
                d.get("master_server_address", d.get("master_server_addr", master_server_addr))
            )
            extra = {k: v for k, v in d.items() if k in ClientConfig.__dataclass_fields__}
        else:
            extra = {}
        del metadata_server, local_buffer_size, rdma_devices, engine  # not needed by kvpool
        if self._client is not None:
            log.warning("setup() called twice; closing the previous client")
            self.close()
        if protocol not in ("tcp", "rdma"):
            log.error("protocol must be 'tcp' or 'rdma', got %r", protocol)
            return _INVALID
        try:
            from kvpool.core.config import parse_size

            host = str(local_hostname)
            cfg_args: dict[str, Any] = {
                "master_address": master_server_addr,
                "memory_size": parse_size(global_segment_size),
                "host_id": host.rsplit(":", 1)[0] if host.count(":") == 1 else host,
                "bind_host": _bind_address(host),
                "transfer_overrides": {"rules": _transport_rules(protocol)},
            }
            cfg_args.update(extra)
            client = Client(ClientConfig(**cfg_args))
            client.setup()
        except Exception as exc:
            log.error("setup failed: %s", exc)
            return _code(exc)
        self._client = client
        self._hostname = client.segment_ids[0] if client.segment_ids else (
            f"{client.host_id}:{client.endpoint.rsplit(':', 1)[-1]}"
        )
        return 0

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = _DEFAULT_SEGMENT) -> int:
        """Mooncake's older two-step init: not needed after setup(); returns 0."""
        return 0 if self._client is not None else _INVALID

    def close(self) -> int:
        """Unmount and release everything; the client's data leaves the pool. Returns 0."""
        if self._client is not None:
            self._client.close()
            self._client = None
        with self._reg_lock:
            self._reg.clear()
            self._reg_starts.clear()
        return 0

    def health_check(self) -> int:
        """0 when set up and the master answers, else a negative code."""
        if self._client is None:
            return int(ErrorCode.CLOSED)
        try:
            self._client.stats()
            return 0
        except Exception as exc:
            return _code(exc)

    def get_hostname(self) -> str:
        """``host:port`` naming this client's segment (usable as preferred_segment)."""
        return self._hostname

    def _c(self) -> Client:
        if self._client is None:
            raise KVPoolError("store is not set up", ErrorCode.CLOSED)
        return self._client

    # ------------------------------------------------------------------ bytes

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like). 0 on success and when the key already
        exists (the stored value is kept), else a negative code."""
        try:
            self._c().put(key, value, config)
            return 0
        except AlreadyExists:
            return 0
        except Exception as exc:
            return _code(exc)

    def get(self, key: str) -> bytes:
        """The value of ``key``, or ``b""`` when missing or unreadable."""
        try:
            return self._c().get(key)
        except Exception as exc:
            if not isinstance(exc, ObjectNotFound):
                log.debug("get %r: %s", key, exc)
            return b""

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """Put many values; 0 when every key is stored (or already existed),
        else the first negative code."""
        if len(keys) != len(values):
            return _INVALID
        try:
            codes = self._c().put_batch(list(keys), list(values), config)
        except Exception as exc:
            return _code(exc)
        for c in codes:
            if c not in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS):
                return int(c)
        return 0

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys`` in order (``b""`` where missing)."""
        try:
            return [v if v is not None else b"" for v in self._c().get_batch(list(keys))]
        except Exception as exc:
            log.debug("get_batch: %s", exc)
            return [b""] * len(keys)

    # ------------------------------------------------------------------ pointers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at address ``buffer_ptr`` (host or GPU) for
        zero-copy put_from/get_into. Returns 0 or a negative code."""
        try:
            device = "cuda" if pointer_is_device(int(buffer_ptr)) else None
            handle = self._c().register_buffer((int(buffer_ptr), int(size)), device=device)
        except Exception as exc:
            return _code(exc)
        start = int(buffer_ptr)
        with self._reg_lock:
            if start in self._reg:
                self._c().unregister_buffer(self._reg[start][1])
            else:
                bisect.insort(self._reg_starts, start)
            self._reg[start] = (start + int(size), handle)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Release a registration made with :meth:`register_buffer`; 0 or negative."""
        start = int(buffer_ptr)
        with self._reg_lock:
            entry = self._reg.pop(start, None)
            if entry is None:
                return _INVALID
            self._reg_starts.remove(start)
        try:
            self._c().unregister_buffer(entry[1])
            return 0
        except Exception as exc:
            return _code(exc)

    def _buffer(self, ptr: int, size: int) -> tuple[Any, int]:
        """The registered handle covering ``[ptr, ptr+size)`` with the offset into
        it, else the raw ``(ptr, size)`` (the engine takes unregistered memory too)."""
        ptr = int(ptr)
        with self._reg_lock:
            i = bisect.bisect_right(self._reg_starts, ptr) - 1
            if i >= 0:
                start = self._reg_starts[i]
                end, handle = self._reg[start]
                if ptr + size <= end:
                    return handle, ptr - start
        return (ptr, int(size)), 0

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (host or GPU). 0 (also for an
        existing key, value kept) or a negative code."""
        try:
            self._c().put_from(key, self._slice(buffer_ptr, size), config)
            return 0
        except AlreadyExists:
            return 0
        except Exception as exc:
            return _code(exc)

    def _slice(self, ptr: int, size: int) -> Any:
        """The buffer for ``[ptr, ptr+size)``: the registered handle when it is
        exactly that region, else a host/GPU view of the address range."""
        handle, off = self._buffer(ptr, size)
        # (an unregistered range comes back as a raw tuple: classify it below,
        # never hand a GPU address on as host memory)
        if off == 0 and not isinstance(handle, tuple) and handle.length == size:
            return handle
        if not isinstance(handle, tuple) and getattr(handle, "is_gpu", False):
            from kvpool.transfer import as_buffer

            return as_buffer((int(ptr), int(size)), device="cuda")
        if isinstance(handle, tuple) and pointer_is_device(int(ptr)):
            from kvpool.transfer import as_buffer

            return as_buffer((int(ptr), int(size)), device="cuda")
        return (int(ptr), int(size))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into ``size`` bytes at ``buffer_ptr``; bytes read, or a
        negative code (OBJECT_NOT_FOUND, BUFFER_OVERFLOW when too small, ...)."""
        try:
            return self._c().get_into(key, self._slice(buffer_ptr, size))
        except Exception as exc:
            return _code(exc)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        """Per-key 0 or negative code; every key gets INVALID_PARAMS when the
        three lists differ in length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [_INVALID] * len(keys)
        try:
            bufs = [self._slice(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
            codes = self._c().batch_put_from(list(keys), bufs, config)
        except Exception as exc:
            return [_code(exc)] * len(keys)
        return [0 if c in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) else int(c)
                for c in codes]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Per-key bytes read or negative code; INVALID_PARAMS for every key when
        the lists differ in length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [_INVALID] * len(keys)
        try:
            bufs = [self._slice(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
            return [int(r) for r in self._c().batch_get_into(list(keys), bufs)]
        except Exception as exc:
            return [_code(exc)] * len(keys)

    # ------------------------------------------------------------------ queries

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not, -1 on error."""
        try:
            return 1 if self._c().exists(key) else 0
        except Exception:
            return -1

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1/0/-1 per key, in input order; [] for []."""
        if not keys:
            return []
        try:
            return [1 if e else 0 for e in self._c().batch_exists(list(keys))]
        except Exception:
            return [-1] * len(keys)

    def get_size(self, key: str) -> int:
        """Size of ``key``'s value, or a negative code."""
        try:
            return self._c().get_size(key)
        except Exception as exc:
            return _code(exc)

    def remove(self, key: str, force: bool = False) -> int:
        """0 when removed; OBJECT_HAS_LEASE while leased (unless ``force``),
        OBJECT_NOT_FOUND when missing."""
        try:
            self._c().remove(key, force=force)
            return 0
        except Exception as exc:
            return _code(exc)

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed, or a negative code."""
        try:
            return self._c().remove_all(force=force)
        except Exception as exc:
            return _code(exc)
