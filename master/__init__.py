"""kvpool.master: the control plane (replica directory, allocators, leases,
eviction, liveness, snapshots + journal) and the protocol every layer shares.

The modules ``errors``, ``common`` and ``protocol`` are the shared bottom of the
dependency graph: store, transfer and connector may import them; the master's
server modules never import store or transfer.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvpool")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
