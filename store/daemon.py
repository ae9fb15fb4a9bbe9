"""The per-node daemon (``kvpool client``): contributes memory (and disk) to the
pool and serves transfers until SIGTERM/SIGINT, then unmounts cleanly.

Same-host processes (e.g. vLLM workers running pure clients) read and write
its segment directly through shared memory; remote ones through its
transfer server. Every ``janitor_interval_s`` it also removes the shared
memory of kvpool processes on this host that died with their guard (kill -9
of both, an OOM kill) and unmounts it at the master
(:meth:`kvpool.store.segment_host.SegmentHost.reap_orphans`).

On 127.0.0.1:``dummy_port`` (50052, Mooncake's ``mooncake_client`` port) it
answers Mooncake standalone clients: ``setup_dummy(..., "127.0.0.1:50052")``
in an engine process GETs :data:`STANDALONE_PATH` and learns the master,
tenant, host id and this daemon's memory segment (JSON, :class:`StandaloneInfo`),
so it needs no configuration of its own.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from kvpool.core import __version__
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.http import JSON, HttpEndpoints
from kvpool.store.client import Client
from kvpool.store.config import DEFAULT_DUMMY_PORT, ClientConfig
from kvpool.store.node_metrics import NodeMetrics

__all__ = ["STANDALONE_PATH", "StandaloneInfo", "run_daemon", "standalone_info"]

#: what a Mooncake standalone client GETs on the daemon's dummy port
STANDALONE_PATH = "/kvpool/standalone"

log = logging.getLogger(__name__)

_JANITOR_INTERVAL_S = 2.0  # a listdir of /dev/shm and one flock per kvpool file


def _write_ready(path: str, info: dict[str, Any]) -> None:
    """Write ``info`` as JSON atomically (temp file + rename) so readers never see half."""
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(info))
    os.replace(tmp, path)


def run_daemon(config: ClientConfig, ready_file: str | None = None,
               stop: threading.Event | None = None,
               janitor_interval_s: float = _JANITOR_INTERVAL_S) -> int:
    """Run a contributing client until ``stop`` is set or SIGTERM/SIGINT arrives.

    Returns the exit code (0 after a clean unmount). ``ready_file`` receives
    ``{pid, client_id, host_id, segment_ids, endpoint, master, tenant,
    dummy_port}`` once the segments are mounted (``dummy_port``: where it
    answers standalone clients, None when it does not). Raises KVPoolError
    (INVALID_PARAMS) when a ``dummy_port`` other than 50052 cannot be bound.
    """
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    client = Client(config)
    http: HttpEndpoints | None = None
    metrics: NodeMetrics | None = None
    standalone: HttpEndpoints | None = None
    answer: list[bytes] = []  # what the standalone port answers, once the segments are up
    try:
        # bound before the segments are mounted (and prefaulted): a port that
        # cannot be had fails the start at once
        standalone = _serve_standalone(config, answer)
        client.setup()
        info = {
            "pid": os.getpid(),
            "client_id": client.client_id,
            "host_id": client.host_id,
            "segment_ids": client.segment_ids,
            "shm_names": client.shm_names,
            "endpoint": client.endpoint,
            "master": config.master_address,
            "tenant": client.tenant,
            "memory_size": config.memory_size,
            "guard_pid": client.segment_host.guard.pid if client.segment_host.guard else None,
        }
        answer.append(msgspec.json.encode(standalone_info(client)))
        info["dummy_port"] = standalone.port if standalone is not None else None
        log.info("node daemon ready: %s", info)
        if config.metrics_port:
            http, metrics = _serve_metrics(client, config.metrics_port, info)
        if ready_file:
            _write_ready(ready_file, info)
        next_janitor = time.monotonic() + janitor_interval_s
        while not stop.wait(min(0.5, janitor_interval_s)):
            if time.monotonic() >= next_janitor:
                next_janitor = time.monotonic() + janitor_interval_s
                client.segment_host.reap_orphans()
        log.info("node daemon stopping: unmounting %s", client.segment_ids)
    finally:
        if standalone is not None:
            standalone.close()
        if http is not None:
            http.close()
        if metrics is not None:
            metrics.close()
        client.close()
    return 0


def _serve_metrics(client: Client, port: int, info: dict[str, Any]
                   ) -> tuple[HttpEndpoints, NodeMetrics]:
    """``/metrics`` (Prometheus: :mod:`kvpool.store.node_metrics`, docs/metrics.md)
    and ``/health`` (JSON) on 127.0.0.1:``port``."""
    metrics = NodeMetrics(client, info)
    try:
        http = HttpEndpoints(metrics.routes(), "127.0.0.1", port, "kvpool-daemon-http")
    except BaseException:
        metrics.close()
        raise
    log.info("node daemon metrics on http://127.0.0.1:%d/{metrics,health}", http.port)
    return http, metrics


class StandaloneInfo(msgspec.Struct, frozen=True):
    """What a standalone client needs from its node daemon (JSON on the
    standalone port): the master address, the tenant it acts for, the host
    id (so its transfers with the daemon go through shared memory) and the
    daemon's memory segment (the standalone store's ``get_hostname()``)."""

    master: str
    tenant: str
    host_id: str
    segment_id: str
    memory_size: int
    pid: int
    kvpool: str  # the daemon's kvpool version


def standalone_info(client: Client) -> StandaloneInfo:
    """This daemon's :class:`StandaloneInfo` (its segments are up)."""
    return StandaloneInfo(
        master=client.config.master_address, tenant=client.tenant, host_id=client.host_id,
        segment_id=client.segment_ids[0] if client.segment_ids else "",
        memory_size=client.config.memory_size, pid=os.getpid(), kvpool=__version__)


def _serve_standalone(config: ClientConfig, answer: list[bytes]) -> HttpEndpoints | None:
    """The dummy-port listener on 127.0.0.1 (loopback only: standalone
    clients run on this host), answering ``answer[0]`` (an encoded
    :class:`StandaloneInfo`; 503 while ``answer`` is empty: the segments are
    not up yet), or None when ``dummy_port`` is 0 or
    the default port is held by another process (a warning: another daemon
    of this host answers there). Raises KVPoolError for any other port that
    cannot be bound."""
    if not config.dummy_port:
        return None

    def route() -> tuple[int, bytes | str, str]:
        if not answer:
            return 503, json.dumps({"error": "starting"}), JSON
        return 200, answer[0], JSON

    try:
        http = HttpEndpoints({STANDALONE_PATH: route}, "127.0.0.1", config.dummy_port,
                             "kvpool-daemon-standalone")
    except OSError as exc:
        if config.dummy_port == DEFAULT_DUMMY_PORT:
            log.warning("standalone clients: 127.0.0.1:%d is taken (%s); this daemon does "
                        "not answer them (set --dummy-port to another port)",
                        config.dummy_port, exc.strerror)
            return None
        raise KVPoolError(f"dummy_port 127.0.0.1:{config.dummy_port}: {exc.strerror}",
                          ErrorCode.INVALID_PARAMS) from None
    log.info("node daemon answers Mooncake standalone clients on 127.0.0.1:%d", http.port)
    return http
