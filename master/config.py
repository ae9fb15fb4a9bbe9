"""The master's configuration (``configs/master.yaml`` documents every key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvpool.core.auth import CurveConfig
from kvpool.core.config import ConfigError, load_dataclass
from kvpool.master.tiering_config import TieringConfig

__all__ = ["FsyncPolicy", "MasterConfig", "load_master_config"]


class FsyncPolicy(StrEnum):
    """When the journal is fsync'ed.

    ``always``: every group commit, before the replies go out (survives power loss).
    ``interval``: written before the replies (survives a master crash / kill -9),
    fsync'ed every ``journal_fsync_interval_ms``.
    ``never``: written before the replies, fsync left to the OS.
    """

    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


@dataclass
class MasterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9003  # 0 disables the admin HTTP server
    data_dir: str | None = None  # None: no journal, no snapshots (state lost on exit)
    lease_ttl_ms: int = 10000
    # soft pins (ReplicateConfig soft_pin / SoftPinAction.ENABLE): a soft-pinned
    # object is evicted after the unpinned ones until its pin expires; a put that
    # names no TTL gets the default, none may ask for more than the maximum
    soft_pin_ttl_ms: int = 30 * 60 * 1000
    max_soft_pin_ttl_ms: int = 24 * 60 * 60 * 1000
    # liveness (docs/INTERFACES.md): a client silent for client_ttl_s is suspect
    # (no new placements, objects kept); one silent, with its guard process, for
    # client_ttl_s + client_grace_s is dropped with its objects (its memory is
    # presumed gone: a dead host, or a frozen cgroup that outlived the grace)
    client_ttl_s: float = 10.0
    client_grace_s: float = 300.0
    eviction_high_watermark: float = 0.9
    eviction_ratio: float = 0.05
    eviction_max_scan: int = 100000  # objects examined per eviction round at most
    eviction_batch: int = 2000  # objects evicted per loop iteration (watermark eviction)
    put_start_discard_timeout_s: float = 30.0  # an in-flight put older than this may be preempted
    put_start_release_timeout_s: float = 600.0  # an in-flight put older than this is revoked
    snapshot_interval_s: float = 300.0  # 0 disables periodic snapshots
    snapshot_min_journal_records: int = 1  # skip a periodic snapshot when nothing changed
    snapshot_keep: int = 2
    snapshot_slice_ms: float = 4.0  # loop time spent serializing a snapshot per iteration
    journal_fsync: FsyncPolicy = FsyncPolicy.INTERVAL
    journal_fsync_interval_ms: int = 100
    max_key_length: int = 4096
    max_batch_size: int = 16384
    max_frame_size: int = 64 * 1024 * 1024
    max_object_size: int = 1 << 44
    max_replica_num: int = 16
    memory_alignment: int = 64
    file_alignment: int = 4096
    expiry_slice: int = 64  # segments dropped per loop iteration at most
    purge_slice: int = 20000  # objects purged from a dropped segment per loop iteration
    log_level: str = "INFO"
    # issue 7: capability-checked data access (docs/security.md). When on, the
    # master creates a key per segment (handed to its owner in the MOUNT reply)
    # and signs a READ/WRITE capability per granted replica.
    capabilities: bool = True
    capability_ttl_ms: int = 0  # 0 = lease_ttl_ms
    # a connection with more requests than this queued at the master in one
    # loop pass gets TOO_MANY_REQUESTS for the excess (back-pressure: its
    # ZeroMQ pipe is also bounded, so a flood stalls in TCP, not in RAM)
    max_inflight_per_client: int = 128
    # same-host RPC over a Unix socket (kvpool.master.local_rpc): ~4x shorter
    # round trips than ZeroMQ for clients on this host. "auto": a 0600 socket in
    # $TMPDIR unless CURVE is on; "off"; or an explicit path.
    local_socket: str = "auto"
    # clients on other hosts: the same framing on an ephemeral TCP port of
    # ``host`` (announced through LOCAL_ENDPOINT; ~3x shorter master round trips
    # than ZeroMQ across hosts); never opened when CURVE is on
    rpc_tcp: bool = True
    # ZeroMQ CURVE on the RPC socket (kvpool.core.auth; docs/security.md):
    # auto = off on loopback binds, required on any other bind
    curve: CurveConfig = field(default_factory=CurveConfig)
    # object events for routers (kvpool.master.events): a ZeroMQ PUB socket on
    # host:events_port (0 = off); each subscriber may queue events_hwm messages,
    # beyond that it misses messages (it sees a seq gap and resyncs)
    events_port: int = 0
    events_hwm: int = 10000
    # SSD tier (kvpool.master.tiering): offload on eviction, promotion, warm restart
    tiering: TieringConfig = field(default_factory=TieringConfig)
    # high availability (kvpool.master.ha, docs/ha.md): "" = a single master.
    # etcd: HOST:PORT[,HOST:PORT...] (or etcd://...); instances with the same etcd
    # and cluster_id elect one leader, the others replicate its journal
    etcd: str = ""
    cluster_id: str = "default"
    advertise: str = ""  # HOST:PORT clients reach this instance at ("": host:port)
    sync_standbys: int = 1  # standbys that must hold a change before it is acknowledged
    sync_timeout_s: float = 0.5  # an in-sync standby silent this long is dropped from the set
    ha_lease_ttl_s: int = 2  # etcd lease TTL: bounds failover and fencing
    replication_port: int = 0  # journal stream to the standbys (0: a free port)

    def validate(self) -> None:
        """Raise ConfigError on values that cannot work."""
        if not 0 < self.eviction_high_watermark <= 1:
            raise ConfigError("eviction_high_watermark must be in (0, 1]")
        if not 0 <= self.eviction_ratio < self.eviction_high_watermark:
            raise ConfigError("eviction_ratio must be in [0, eviction_high_watermark)")
        for name in ("lease_ttl_ms", "max_key_length", "max_batch_size", "max_frame_size",
                     "memory_alignment", "file_alignment", "expiry_slice", "purge_slice",
                     "max_replica_num", "snapshot_keep", "eviction_max_scan",
                     "eviction_batch", "max_inflight_per_client", "events_hwm"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        for name in ("memory_alignment", "file_alignment"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ConfigError(f"{name} must be a power of two")
        if self.client_ttl_s <= 0:
            raise ConfigError("client_ttl_s must be > 0")
        if self.client_grace_s < 0:
            raise ConfigError("client_grace_s must be >= 0")
        if not all(0 <= p < 65536 for p in (self.port, self.metrics_port, self.events_port)):
            raise ConfigError("ports must be in [0, 65535]")
        if not 0 <= self.soft_pin_ttl_ms <= self.max_soft_pin_ttl_ms:
            raise ConfigError("soft_pin_ttl_ms must be in [0, max_soft_pin_ttl_ms]")
        if self.capability_ttl_ms < 0:
            raise ConfigError("capability_ttl_ms must be >= 0 (0 = lease_ttl_ms)")
        if self.snapshot_slice_ms <= 0:
            raise ConfigError("snapshot_slice_ms must be > 0")
        if self.snapshot_interval_s < 0:
            raise ConfigError("snapshot_interval_s must be >= 0")
        if self.sync_standbys < 0:
            raise ConfigError("sync_standbys must be >= 0")
        if self.sync_timeout_s <= 0:
            raise ConfigError("sync_timeout_s must be > 0")
        if self.ha_lease_ttl_s < 1:
            raise ConfigError("ha_lease_ttl_s must be >= 1")
        if not 0 <= self.replication_port < 65536:
            raise ConfigError("replication_port must be in [0, 65535]")
        if self.etcd:
            from kvpool.core.etcd import parse_etcd_url

            try:
                parse_etcd_url(self.etcd, self.cluster_id or None)
            except ValueError as exc:
                raise ConfigError(f"etcd: {exc}") from None
        self.tiering.validate()


def load_master_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> MasterConfig:
    """Defaults, then the YAML file (if any), then non-None ``overrides``."""
    return load_dataclass(MasterConfig, path, overrides)
