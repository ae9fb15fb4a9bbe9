"""kvpool.cluster: run and operate a pool.

:class:`LocalCluster` (a master and node daemons as real processes on this
host: what ``kvpool demo``, the benchmarks and the tests start), the process
managers it is made of, and the ``kvpool`` console script with the
operator subcommands (``status``, ``demo``, ``keygen``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_WHERE = {
    "LocalCluster": "kvpool.cluster.local",
    "ManagedProcess": "kvpool.cluster.processes",
    "MasterProcess": "kvpool.cluster.processes",
    "NodeDaemonProcess": "kvpool.cluster.processes",
    "find_free_port": "kvpool.cluster.processes",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
