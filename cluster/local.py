"""A whole pool on this host: one master and ``nodes`` node daemons, as processes.

    with LocalCluster(nodes=2, memory="256MiB") as cluster:
        with Client(ClientConfig(master_address=cluster.address)) as c:
            c.put("k", b"v")
        cluster.daemons[0].kill()          # a node crash

Everything it starts is stopped on exit (or on a failed start), and a
temporary work dir it made is removed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from typing import Self

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

__all__ = ["LocalCluster"]


class LocalCluster:
    """A master and ``nodes`` node daemons of ``memory`` each on loopback.

    ``work_dir`` holds the master's data dir and every log (a temp dir,
    removed on close, when not given). ``master_args`` / ``daemon_args`` are
    extra CLI flags. ``address`` is what clients pass as ``master_address``.
    """

    def __init__(
        self,
        nodes: int = 2,
        memory: str | int = "64MiB",
        work_dir: str | None = None,
        client_ttl_s: float = 10,
        lease_ttl_ms: int = 10000,
        master_args: Sequence[str] = (),
        daemon_args: Sequence[str] = (),
    ) -> None:
        self._own_dir = work_dir is None
        self.work_dir = work_dir or tempfile.mkdtemp(prefix="kvpool-cluster-")
        self.master = MasterProcess(data_dir=f"{self.work_dir}/master",
                                    client_ttl_s=client_ttl_s, lease_ttl_ms=lease_ttl_ms,
                                    extra_args=master_args)
        self.daemons = [NodeDaemonProcess("", memory, log_dir=f"{self.work_dir}/daemon{i}",
                                          extra_args=daemon_args)
                        for i in range(nodes)]

    @property
    def address(self) -> str:
        """The master's ``HOST:PORT``."""
        return self.master.address

    @property
    def segment_ids(self) -> list[str]:
        return [s for d in self.daemons for s in d.segment_ids]

    def start(self) -> Self:
        """Start the master, then every daemon; return once all segments are mounted."""
        try:
            self.master.start()
            for d in self.daemons:
                d.master_address = self.master.address
                d.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every daemon (clean unmount), then the master; remove an own work dir."""
        for d in self.daemons:
            d.stop()
            d._cleanup()
        self.master.stop()
        self.master._cleanup()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
