"""kvpool.master: the control plane (replica directory, allocators, leases,
eviction, liveness, snapshots + journal, SSD-tier policy).

Nothing outside the master imports it except its entry point (``kvpool
master``) and tests; what clients share with it lives in :mod:`kvpool.core`.
"""

__all__: list[str] = []
