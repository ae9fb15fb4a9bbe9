"""The master's SSD-tier settings (``tiering:`` in configs/master.yaml).

Kept apart from :mod:`kvpool.master.tiering` so the master config can import it
without importing the directory (which imports the config).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.config import ConfigError

__all__ = ["TieringConfig"]


@dataclass
class TieringConfig:
    """Tiering knobs (the master config's ``tiering`` fields map onto these).

    ``offload_on_evict``: true | false | "auto" (on when a FILE segment exists).
    ``offload_ahead_watermark``: above this fraction of memory in use, the
    least recently used memory-only objects are copied to disk ahead of
    eviction (memory kept), so eviction can free them at once (0 = off).
    ``offload_ahead_bytes``: bytes of such copies started per timer tick.
    ``promote_on_hit``: copy a disk-only object back into memory when read,
    at its ``promote_after_hits``-th read from disk (1 = at the first; hits
    are remembered for the last 100k keys read from disk). A promotion
    reads the object from disk a second time: the default 2 spares that
    read, and the memory, to objects read once.
    ``task_timeout_s``: a task not reported done by then is failed (its
    destination allocation freed). ``max_tasks_per_ping``: tasks handed to one
    node per PING reply. ``file_owner_ttl_s``: how long a FILE segment whose
    owner died waits for it (0 = drop with the owner, like memory).
    ``max_inflight_bytes``: bytes of tasks in flight at once (0 = no limit).
    """

    offload_on_evict: bool | str = "auto"
    offload_ahead_watermark: float = 0.7
    offload_ahead_bytes: int = 256 << 20
    promote_on_hit: bool = True
    promote_after_hits: int = 2
    task_timeout_s: float = 30.0
    max_tasks_per_ping: int = 64
    file_owner_ttl_s: float = 3600.0
    max_inflight_bytes: int = 0

    def validate(self) -> None:
        if isinstance(self.offload_on_evict, str):
            low = self.offload_on_evict.lower()
            if low not in ("auto", "true", "false"):
                raise ConfigError("offload_on_evict must be true, false or auto")
            self.offload_on_evict = "auto" if low == "auto" else low == "true"
        if not 0 <= self.offload_ahead_watermark < 1 or self.offload_ahead_bytes < 0:
            raise ConfigError("offload_ahead_watermark must be in [0, 1), "
                              "offload_ahead_bytes >= 0")
        if self.promote_after_hits < 1:
            raise ConfigError("promote_after_hits must be >= 1")
        if self.task_timeout_s <= 0 or self.max_tasks_per_ping < 1:
            raise ConfigError("task_timeout_s must be > 0 and max_tasks_per_ping >= 1")
        if self.file_owner_ttl_s < 0 or self.max_inflight_bytes < 0:
            raise ConfigError("file_owner_ttl_s and max_inflight_bytes must be >= 0")
