"""The connector's handle on a kvpool store client, tolerant of a dead store.

vLLM must keep serving when kvpool is down, so every store call here either
succeeds or raises :class:`StoreUnavailable` fast: the client is created
lazily, and after a connection failure the store is skipped for
``retry_interval_s`` (a circuit breaker) instead of waiting for an RPC
timeout on every step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.connector.config import ConnectorConfig
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.transfer.gpu import independent_copies

__all__ = ["StoreAccess", "StoreUnavailable", "client_config", "make_client", "put_from_ready"]

log = logging.getLogger("kvpool.connector")

# Codes meaning "the store itself is unreachable" (open the circuit), as
# opposed to per-key outcomes such as OBJECT_NOT_FOUND.
_DOWN_CODES = {ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT, ErrorCode.CLOSED, ErrorCode.TIMEOUT}


class StoreUnavailable(KVPoolError):
    """The store is down or was recently (circuit open); the caller falls back."""

    code = ErrorCode.RPC_FAIL


def client_config(cfg: ConnectorConfig) -> Any:
    """The store :class:`~kvpool.store.ClientConfig` of the connector, built by
    the store's own loader (:func:`~kvpool.store.config.client_config_from_env`):
    the client YAML (``client_config``, else ``$KVPOOL_CONFIG``), the cluster
    key of ``$KVPOOL_CURVE_KEY_DIR``, ``client_overrides``, then
    ``master_address``, ``local_address`` (bind and advertised address of this
    process's transfer server), ``host_id`` and ``tenant`` on top. The one
    place the connector builds it. Raises ConfigError (e.g. a bad tenant name)."""
    from kvpool.store.config import client_config_from_env

    overrides: dict[str, Any] = {"rpc_timeout_s": cfg.rpc_timeout_s}
    overrides.update(cfg.client_overrides)
    if cfg.master_address:
        overrides["master_address"] = cfg.master_address
    if cfg.local_address:
        overrides["bind_host"] = cfg.local_address
    if cfg.host_id:
        overrides["host_id"] = cfg.host_id
    if cfg.tenant:
        overrides["tenant"] = cfg.tenant
    return client_config_from_env(overrides, path=cfg.client_config)


def put_from_ready(client: Any, keys: list[str], bufs: Sequence[Any], config: Any) -> list[Any]:
    """``client.batch_put_from`` of buffers whose bytes are ready (the save
    thread synchronised with what wrote them): on a GPU the copies need not
    queue behind the forward's kernels on the default stream."""
    with independent_copies():
        return list(client.batch_put_from(keys, bufs, config))


def make_client(cfg: ConnectorConfig) -> Any:
    """A set-up :class:`kvpool.store.Client` for ``cfg`` (pure client: contributes
    no memory unless the YAML/overrides say so)."""
    from kvpool.store import Client

    return Client(client_config(cfg)).setup()


class StoreAccess:
    """Lazily connected store client plus circuit breaker. Thread-safe.

    ``call(fn)`` runs ``fn(client)``; connection-level failures mark the store
    down for ``retry_interval_s`` and raise :class:`StoreUnavailable`; other
    :class:`KVPoolError`\\ s propagate unchanged. ``on_connect(client)`` runs once
    per new client (e.g. to register KV-cache buffers).
    """

    def __init__(self, cfg: ConnectorConfig,
                 factory: Callable[[ConnectorConfig], Any] = make_client) -> None:
        self.cfg = cfg
        self._factory = factory
        self._client: Any = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._closed = False
        self.on_connect: Callable[[Any], None] | None = None
        self.failures = 0

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def client(self) -> Any:
        """The connected client, connecting if needed; raises StoreUnavailable."""
        if self._closed:
            raise StoreUnavailable("connector closed", ErrorCode.CLOSED)
        c = self._client
        if c is not None:
            return c
        with self._lock:
            if self._client is not None:
                return self._client
            if self.is_down:
                raise StoreUnavailable("kvpool store unavailable (retrying later)")
            try:
                c = self._factory(self.cfg)
            except Exception as exc:  # any failure to connect: serve without the store
                self._mark_down(exc)
                raise StoreUnavailable(f"cannot connect to kvpool: {exc}") from exc
            if self.on_connect is not None:
                try:
                    self.on_connect(c)
                except Exception as exc:
                    log.warning("kvpool: post-connect setup failed (continuing): %s", exc)
            self._client = c
            return c

    def _mark_down(self, exc: BaseException) -> None:
        self.failures += 1
        if not self.is_down:
            log.warning("kvpool store unavailable, skipping it for %.1fs: %s",
                        self.cfg.retry_interval_s, exc)
        self._down_until = time.monotonic() + self.cfg.retry_interval_s

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(client)``; see the class docstring for the error contract."""
        if self.is_down:
            raise StoreUnavailable("kvpool store unavailable (retrying later)")
        c = self.client()
        try:
            return fn(c)
        except KVPoolError as exc:
            if exc.code in _DOWN_CODES:
                self._mark_down(exc)
                raise StoreUnavailable(str(exc), exc.code) from exc
            raise
        except OSError as exc:
            self._mark_down(exc)
            raise StoreUnavailable(str(exc)) from exc

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self.call(lambda c: c.batch_exists(list(keys))))

    def batch_locate(self, keys: Sequence[str]) -> tuple[list[Any], Any]:
        """Per key its complete replicas, nearest first (``ReplicaLocation``), or
        None when missing, and the reply they came from (a
        :class:`~kvpool.store.located.Located`: a worker can read from it
        without locating again); one master RPC (see Client.locate_for_reads)."""
        def locate(c: Any) -> tuple[list[Any], Any]:
            located = c.locate_for_reads(list(keys))
            return list(c.replica_locations(located)), located

        out: tuple[list[Any], Any] = self.call(locate)
        return out

    def close(self) -> None:
        """Close the client (idempotent)."""
        self._closed = True
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception as exc:  # closing must not fail shutdown
                log.debug("kvpool client close: %s", exc)
