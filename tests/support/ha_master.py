"""HA master instances for tests and ``scripts/bench_ha.py``: ``kvpool master
--etcd ...`` subprocesses on free loopback ports, ready once ``GET /health``
answers, plus helpers to read every instance's health and wait for a role.

    with EtcdProcess() as etcd:
        group = HaGroup(etcd.endpoint, "c1", workdir, n=3).start()
        leader = group.wait_leader(in_sync=2)
        leader.kill()                         # kill -9
        group.url                             # etcd://127.0.0.1:P/c1
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any, Self

from kvpool.cluster.processes import ManagedProcess, find_free_port, unlink_master_socket

__all__ = ["HaGroup", "HaMasterProcess", "health"]


_handed_out: set[int] = set()  # ports _stable_port gave in this process


def _stable_port() -> int:
    """A free loopback port below the kernel's ephemeral range: an instance
    keeps its ports across restarts, and in the gap after a kill -9 no
    outgoing connection (source ports come from that range) or port-0 bind
    elsewhere on the box can take a port from there."""
    low = 32768
    with contextlib.suppress(OSError, ValueError), \
            open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    if low <= 12000:
        return find_free_port()
    for _ in range(100):
        port = random.randrange(10000, low)
        if port in _handed_out:  # free now, but an instance of this run holds it
            continue  # for its life (one stopped or killed, waiting to restart)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    return find_free_port()


def health(metrics_port: int, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """``GET /health`` of one instance (None when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health",
                                    timeout=timeout_s) as r:
            return dict(json.load(r))
    except (OSError, ValueError):
        return None


class HaMasterProcess(ManagedProcess):
    """One ``kvpool master --etcd`` instance; ports fixed at construction so
    ``restart()`` brings the same instance (same id, same data dir) back."""

    _what = "HA master"

    def __init__(self, etcd: str, cluster_id: str, data_dir: str,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 20.0) -> None:
        super().__init__()
        self.etcd = etcd
        self.cluster_id = cluster_id
        self.data_dir = data_dir
        os.makedirs(data_dir, exist_ok=True)
        self.port = _stable_port()
        self.metrics_port = _stable_port()
        self.replication_port = _stable_port()
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.log_path = os.path.join(data_dir, "master.log")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvpool.cluster.cli", "master",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--data-dir", self.data_dir,
                "--etcd", self.etcd, "--cluster-id", self.cluster_id,
                "--config", self._config_file(), *self.extra_args]

    def _config_file(self) -> str:
        path = os.path.join(self.data_dir, "ha.yaml")
        with open(path, "w") as f:
            f.write(f"replication_port: {self.replication_port}\n")
        return path

    def start(self) -> Self:
        if self.running:
            return self
        proc = self._spawn(self.command())
        deadline = time.monotonic() + self.start_timeout_s
        while health(self.metrics_port, 0.5) is None:
            if proc.poll() is not None:
                self._reap()
                raise RuntimeError(f"HA master exited with {proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"HA master not up in {self.start_timeout_s}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        return self

    def health(self) -> dict[str, Any] | None:
        return health(self.metrics_port) if self.running else None

    def _cleanup(self) -> None:
        unlink_master_socket(self.port)  # left behind when it was killed


class HaGroup:
    """``n`` instances of one cluster id sharing an etcd."""

    def __init__(self, etcd: str, cluster_id: str, workdir: str, n: int = 3,
                 extra_args: Sequence[str] = ()) -> None:
        self.etcd = etcd
        self.cluster_id = cluster_id
        self.members = [HaMasterProcess(etcd, cluster_id, os.path.join(workdir, f"m{i}"),
                                        extra_args) for i in range(n)]

    @property
    def url(self) -> str:
        return f"etcd://{self.etcd}/{self.cluster_id}"

    def start(self) -> Self:
        for m in self.members:
            m.start()
        return self

    def wait_leader(self, in_sync: int = 1, timeout_s: float = 20.0,
                    exclude: HaMasterProcess | None = None,
                    streaming: int = 0) -> HaMasterProcess:
        """The instance serving as leader with ``in_sync`` in-sync standbys and
        ``streaming`` standbys connected and streaming (in sync or not)."""
        deadline = time.monotonic() + timeout_s
        last: list[Any] = []
        while time.monotonic() < deadline:
            last = []
            for m in self.members:
                if m is exclude or not m.running:
                    continue
                h = m.health()
                last.append(h)
                sbs = h.get("standbys", ()) if h else ()
                if h and h.get("role") == "leader" \
                        and sum(1 for s in sbs if s["in_sync"]) >= in_sync \
                        and sum(1 for s in sbs if s["state"] == "streaming") >= streaming:
                    return m
            time.sleep(0.05)
        raise TimeoutError(f"no leader with {in_sync} in-sync standbys: {last}")

    def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                m.close()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
