"""The master's SSD-tier settings (``tiering:`` in configs/master.yaml).

Kept apart from :mod:`kvpool.master.tiering` so the master config can import it
without importing the directory (which imports the config).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.config import ConfigError, setting

__all__ = ["TieringConfig"]


@dataclass
class TieringConfig:
    """Tiering knobs (the ``tiering:`` block of the master config; flags
    ``--tiering-<key>``)."""

    offload_on_evict: bool | str = setting(
        "auto", help="evicted memory objects are copied to a file segment first (by the node "
        "holding them): true | false | auto (on when a file segment is mounted)")
    offload_ahead_watermark: float = setting(
        0.7, help="above this fraction of memory in use, the least recently used memory-only "
        "objects are copied to disk ahead of eviction (memory kept), so eviction can free them "
        "at once; 0 = off")
    offload_ahead_bytes: int = setting(
        256 << 20, size=True,
        help="bytes of such ahead-of-eviction copies started per timer tick")
    promote_on_hit: bool = setting(
        True, help="a get served from disk copies the object back into memory")
    promote_after_hits: int = setting(
        2, aliases=("--promote-after-hits",),
        help="promote a disk-only object into memory at its Nth read from disk (1 = the "
        "first; hits are remembered for the last 100k keys read from disk). A promotion reads "
        "the disk a second time: 2 spares that read, and the memory, to objects read once")
    task_timeout_s: float = setting(
        30.0, help="a copy task not reported done by then is failed (its destination freed)")
    max_tasks_per_ping: int = setting(64, help="copy tasks handed to one node per PING reply")
    file_owner_ttl_s: float = setting(
        3600.0, help="a file segment whose owner died waits this long for it (warm restart "
        "re-adopts its objects); 0 = dropped with its owner, like memory")
    max_inflight_bytes: int = setting(
        0, size=True, help="bytes of copy tasks in flight at once; 0 = no limit")

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
