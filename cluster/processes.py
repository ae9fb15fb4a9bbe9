"""Run a real kvpool pool as processes: the master, node daemons, a whole local cluster.

What ``kvpool demo``, the benchmarks and the tests use::

    with MasterProcess(data_dir=str(tmp_path)) as m, NodeDaemonProcess(m.address, "64MiB") as d:
        client = MasterClient(m.address)
        d.segment_ids          # mounted at the master once start() returned
        m.kill(); m.restart()
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import IO, Any, Self

from kvpool.core.config import parse_size
from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.core.local_socket import default_socket_path, remove_stale_socket
from kvpool.core.protocol import ListSegments, Stats
from kvpool.core.rpc_client import MasterClient, MasterRPCError

__all__ = ["ManagedProcess", "MasterProcess", "NodeDaemonProcess", "find_free_port",
           "unlink_master_socket"]

log = logging.getLogger(__name__)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (bind to 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedProcess:
    """The subprocess lifecycle shared by the test helpers (MasterProcess here,
    NodeDaemonProcess): spawn with output to ``log_path``,
    ``stop()`` (SIGTERM, then SIGKILL after a timeout), ``kill()`` (SIGKILL),
    ``restart()``, ``log_tail()``, ``close()`` (stop and ``_cleanup()``) and
    the context manager (start on enter, close on exit). Subclasses define ``start()`` (spawn via
    ``_spawn()`` and wait until ready), ``log_path`` and ``_what`` (the name
    in log messages).
    """

    _what = "process"
    log_path: str

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Spawn the process and return once it is ready (subclasses)."""
        raise NotImplementedError

    def _spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` with stdout+stderr appended to ``log_path`` (closed in ``_reap``)."""
        log_file = open(self.log_path, "ab")
        self._log_file = log_file
        self._proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        return self._proc

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` bytes of the log, decoded ("" when unreadable)."""
        try:
            with open(self.log_path, "rb") as f:
                data = f.read()
            return data[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _reap(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout_s``); return the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s %s ignored SIGTERM; killing", self._what, self._proc.pid)
                self._proc.kill()
                self._proc.wait()
        self._reap()
        return self._proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown) and wait."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._reap()

    def restart(self, kill: bool = False) -> Self:
        """Stop (or kill) and ``start()`` again with the same settings."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start()

    def _cleanup(self) -> None:
        """Remove what this helper created (run on context exit, after ``stop()``)."""

    def close(self) -> None:
        """``stop()``, then remove what this helper created (the context exit)."""
        self.stop()
        self._cleanup()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:  # __exit__ will not run: do its work here
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def unlink_master_socket(port: int) -> None:
    """Remove the local-RPC socket file a master on ``port`` left when it was
    killed (kill -9 skips its own unlink); one a live process listens on stays."""
    path = default_socket_path(port)
    try:
        if not remove_stale_socket(path):
            log.debug("%s is served by a live process: kept", path)
    except OSError as exc:
        log.warning("could not check %s: %s", path, exc)


class MasterProcess(ManagedProcess):
    """A ``kvpool master`` subprocess on a free loopback port.

    ``start()`` returns once the master answers (a STATS probe); ``stop()`` sends SIGTERM
    and waits (clean shutdown: journal flushed); ``kill()`` sends SIGKILL;
    ``restart()`` starts it again with the same port and data dir. Also a
    context manager (start on enter, stop on exit). Output goes to
    ``log_path`` (inside ``data_dir`` when given, else a temp file).
    ``curve_key`` (a ``*.key_secret`` file) turns CURVE on; ``client()`` then
    authenticates with the same cluster keypair.
    """

    _what = "master"

    def __init__(
        self,
        data_dir: str | None = None,
        port: int | None = None,
        metrics_port: int = 0,
        lease_ttl_ms: int = 10000,
        client_ttl_s: float = 10,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 20.0,
        curve_key: str | None = None,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.port = port or find_free_port()
        self.metrics_port = metrics_port
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.curve_key = curve_key  # a *.key_secret: CURVE on, clients use the same key
        if data_dir:
            os.makedirs(data_dir, exist_ok=True)
            self.log_path = os.path.join(data_dir, "master.log")
        else:
            name = f"kvpool-master-{self.port}-{uuid.uuid4().hex[:6]}.log"
            self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), name)
            # also when used without ``with`` or when start() fails: gone at GC/exit
            weakref.finalize(self, _unlink_quietly, self.log_path)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` (what MasterClient and ClientConfig take)."""
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "kvpool.cluster.cli", "master",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--metrics-port", str(self.metrics_port),
            "--lease-ttl-ms", str(self.lease_ttl_ms),
            "--client-ttl-s", str(self.client_ttl_s),
        ]
        if self.data_dir:
            cmd += ["--data-dir", self.data_dir]
        if self.curve_key:
            cmd += ["--curve", "on", "--curve-key", self.curve_key]
        return cmd + self.extra_args

    def start(self) -> Self:
        """Spawn the master and wait until it answers a STATS probe (raises on timeout/exit)."""
        if self.running:
            return self
        proc = self._spawn(self.command())
        deadline = time.monotonic() + self.start_timeout_s
        with self.client(timeout_s=0.5) as c:
            while True:
                if proc.poll() is not None:
                    self._reap()
                    raise KVPoolError(
                        f"master exited with {proc.returncode} at startup; "
                        f"see {self.log_path}:\n{self.log_tail()}",
                        ErrorCode.INTERNAL_ERROR,
                    )
                try:
                    c.call(Stats())  # read-only: the probe leaves no client record
                    return self
                except MasterRPCError:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise KVPoolError(
                            f"master did not answer within {self.start_timeout_s}s; "
                            f"see {self.log_path}", ErrorCode.RPC_TIMEOUT,
                        ) from None
                    time.sleep(0.05)

    def client(self, timeout_s: float = 5.0) -> MasterClient:
        """A new MasterClient to this master (caller closes it); with
        ``curve_key`` it authenticates with that (cluster) keypair."""
        if self.curve_key:
            from kvpool.core.auth import load_keypair

            kp = load_keypair(self.curve_key)
            return MasterClient(self.address, timeout_s=timeout_s, curve_server_key=kp.public,
                                curve_keypair=(kp.public, kp.secret))
        return MasterClient(self.address, timeout_s=timeout_s)

    def _cleanup(self) -> None:
        if not self.data_dir:
            _unlink_quietly(self.log_path)
        unlink_master_socket(self.port)


class NodeDaemonProcess(ManagedProcess):
    """A ``kvpool client`` subprocess contributing ``memory`` to ``master_address``.

    ``start()`` returns once the daemon's segment is mounted at the master
    (its ready file is written and LIST_SEGMENTS shows every segment id);
    ``stop()`` sends SIGTERM (clean unmount) and waits; ``kill()`` SIGKILLs
    (a crash: its guard process unmounts it); ``restart()`` starts a
    new daemon (new client id and segment id). Context manager: start/stop.
    """

    _what = "node daemon"

    def __init__(
        self,
        master_address: str,
        memory: str | int = "64MiB",
        host_id: str | None = None,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 30.0,
        log_dir: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.master_address = master_address
        self.memory = parse_size(memory)
        self.host_id = host_id
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.env = env
        self._own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="kvpool-daemon-")
        os.makedirs(self.dir, exist_ok=True)
        self.info: dict[str, Any] = {}
        self._n = 0

    @property
    def segment_ids(self) -> list[str]:
        return list(self.info.get("segment_ids", []))

    @property
    def client_id(self) -> str:
        return str(self.info.get("client_id", ""))

    @property
    def log_path(self) -> str:  # type: ignore[override]  # per-start file; read-only here
        return os.path.join(self.dir, f"daemon-{self._n}.log")

    def command(self, ready_file: str) -> list[str]:
        cmd = [sys.executable, "-m", "kvpool.cluster.cli", "client",
               "--master", self.master_address, "--memory", str(self.memory),
               "--ready-file", ready_file]
        if self.host_id:
            cmd += ["--host-id", self.host_id]
        return cmd + self.extra_args

    def start(self) -> Self:
        """Spawn the daemon; return once its segments are mounted (raise on exit/timeout)."""
        if self.running:
            return self
        self._n += 1
        ready = os.path.join(self.dir, f"ready-{self._n}.json")
        proc = self._spawn(self.command(ready), env=dict(os.environ, **(self.env or {})))
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(ready):
            if proc.poll() is not None:
                self._reap()
                raise KVPoolError(f"node daemon exited with {proc.returncode} at startup:\n"
                                  + self.log_tail(), ErrorCode.INTERNAL_ERROR)
            if time.monotonic() > deadline:
                self.kill()
                raise KVPoolError(f"node daemon not ready within {self.start_timeout_s}s:\n"
                                  + self.log_tail(), ErrorCode.TIMEOUT)
            time.sleep(0.02)
        with open(ready) as f:
            self.info = json.load(f)
        self._wait_mounted(deadline)
        return self

    def _master_client(self) -> MasterClient:
        """A MasterClient; authenticated with the daemon's ``--curve-key``
        (a cluster key) when its extra_args give one."""
        args = self.extra_args
        if "--curve-key" in args:
            from kvpool.core.auth import load_keypair

            kp = load_keypair(args[args.index("--curve-key") + 1])
            return MasterClient(self.master_address, timeout_s=2.0, curve_server_key=kp.public,
                                curve_keypair=(kp.public, kp.secret))
        return MasterClient(self.master_address, timeout_s=2.0)

    def _wait_mounted(self, deadline: float) -> None:
        want = set(self.segment_ids)
        with self._master_client() as mc:
            while True:
                try:
                    segs = mc.call(ListSegments()).segments
                    if want <= {s.descriptor.segment_id for s in segs}:
                        return
                except MasterRPCError as exc:
                    log.debug("LIST_SEGMENTS: %s", exc)
                if time.monotonic() > deadline:
                    raise KVPoolError(f"segments {sorted(want)} not mounted in time",
                                      ErrorCode.TIMEOUT)
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL (a crash) and wait. Its guard process frees its /dev/shm
        segment and unmounts it; removed here too in case the guard was
        disabled (``--no-guard``)."""
        super().kill()
        self._unlink_orphans()

    def _unlink_orphans(self) -> None:
        pid = self.info.get("pid")
        if pid is None or self._proc is None or self._proc.pid != pid:
            return
        for name in self.info.get("shm_names", []):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass

    def _cleanup(self) -> None:
        if self._own_dir:
            for name in os.listdir(self.dir):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self.dir)
            except OSError:
                pass
