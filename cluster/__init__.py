"""kvpool.cluster: run and operate a pool.

:class:`LocalCluster` (a master and node daemons as real processes on this
host: what ``kvpool demo``, the benchmarks and the tests start), the process
managers it is made of, and the ``kvpool`` console script with the
operator subcommands (``status``, ``demo``, ``keygen``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.core.lazy import lazy_exports

if TYPE_CHECKING:
    from kvpool.cluster.local import LocalCluster
    from kvpool.cluster.processes import (
        ManagedProcess,
        MasterProcess,
        NodeDaemonProcess,
        find_free_port,
    )

__all__ = ["LocalCluster", "ManagedProcess", "MasterProcess", "NodeDaemonProcess",
           "find_free_port"]

__getattr__ = lazy_exports(__name__, {
    "kvpool.cluster.local": ["LocalCluster"],
    "kvpool.cluster.processes": ["ManagedProcess", "MasterProcess", "NodeDaemonProcess",
                                 "find_free_port"],
})
