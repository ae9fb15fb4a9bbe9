"""Test helpers: run a real ``kvpool client`` node daemon as a subprocess.

Usage::

    with MasterProcess() as m, NodeDaemonProcess(m.address, "64MiB") as d:
        d.segment_ids          # mounted at the master once start() returned
        d.kill(); d.restart()
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Self

from kvpool.master.common import parse_size
from kvpool.master.errors import ErrorCode, KVPoolError
from kvpool.master.protocol import Op
from kvpool.master.rpc_client import MasterClient, MasterRPCError
from kvpool.master.testing import ManagedProcess, closing_factory
from kvpool.store.client import Client
from kvpool.store.config import ClientConfig

__all__ = ["NodeDaemonProcess", "client_factory"]

log = logging.getLogger(__name__)


@contextmanager
def client_factory(master_address: str, **defaults: Any) -> Iterator[Callable[..., Client]]:
    """For "make_client" fixtures: yields ``make(**kw)``, which builds a Client of
    ``ClientConfig(**kw)`` (``master_address`` and ``defaults`` filled in where
    ``kw`` lacks them) and sets it up; every client made is closed on exit."""

    def make(**kw: Any) -> Client:
        kw.setdefault("master_address", master_address)
        for k, v in defaults.items():
            kw.setdefault(k, v)
        c = Client(ClientConfig(**kw))
        c.setup()
        return c

    with closing_factory(make) as factory:
        yield factory


class NodeDaemonProcess(ManagedProcess):
    """A ``kvpool client`` subprocess contributing ``memory`` to ``master_address``.

    ``start()`` returns once the daemon's segment is mounted at the master
    (its ready file is written and LIST_SEGMENTS shows every segment id);
    ``stop()`` sends SIGTERM (clean unmount) and waits; ``kill()`` SIGKILLs
    (a crash: the master drops it after ``client_ttl``); ``restart()`` starts a
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
        cmd = [sys.executable, "-m", "kvpool.store.cli", "client",
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
            from kvpool.master.auth import load_keypair

            kp = load_keypair(args[args.index("--curve-key") + 1])
            return MasterClient(self.master_address, timeout_s=2.0, curve_server_key=kp.public,
                                curve_keypair=(kp.public, kp.secret))
        return MasterClient(self.master_address, timeout_s=2.0)

    def _wait_mounted(self, deadline: float) -> None:
        want = set(self.segment_ids)
        with self._master_client() as mc:
            while True:
                try:
                    segs = mc.call(Op.LIST_SEGMENTS).get("segments", [])
                    if want <= {s.get("segment_id") for s in segs}:
                        return
                except MasterRPCError as exc:
                    log.debug("LIST_SEGMENTS: %s", exc)
                if time.monotonic() > deadline:
                    raise KVPoolError(f"segments {sorted(want)} not mounted in time",
                                      ErrorCode.TIMEOUT)
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL (a crash) and wait. Its /dev/shm segment is removed here, as
        the dead process cannot; the master drops the client after client_ttl."""
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
