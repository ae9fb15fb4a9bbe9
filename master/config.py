"""The master's configuration (``configs/master.yaml`` documents every key)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from zmq.utils import z85

from kvpool.core.auth import CurveConfig, curve_required, load_public_key
from kvpool.core.config import ConfigError, load_dataclass, setting
from kvpool.core.errors import KVPoolError
from kvpool.core.tenants import tenant_name
from kvpool.master.tiering_config import TieringConfig

__all__ = ["FsyncPolicy", "MasterConfig", "ReplicationTransport", "TenantQuota",
           "load_master_config", "tenant_quotas"]


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


class ReplicationTransport(StrEnum):
    """How the journal stream travels to the standbys (docs/ha.md).

    ``socket``: a plain TCP connection per standby, served on the leader's
    loop (two thread wake-ups per round trip). ``zmq``: ZeroMQ (six; the
    only one that can carry CURVE). ``auto``: ``socket`` unless CURVE is
    active for ``host``, then ``zmq``.
    """

    AUTO = "auto"
    SOCKET = "socket"
    ZMQ = "zmq"


@dataclass
class TenantQuota:
    """One tenant's limits (an entry of ``tenants:``, or ``default_tenant_quota:``;
    docs/tenants.md). Bytes of object data (size x replicas); -1 = unlimited."""

    memory: int = setting(-1, size=True, help="bytes of memory replicas at most; -1 = unlimited")
    disk: int = setting(
        -1, size=True, help="bytes of disk (file segment) replicas at most; -1 = unlimited")
    guaranteed: int = setting(
        -1, size=True, help="memory share kept under pool-wide pressure: tenants above theirs "
        "are evicted first; -1 = none")

    def validate(self) -> None:
        for name in ("memory", "disk", "guaranteed"):
            if getattr(self, name) < -1:
                raise ConfigError(f"{name} must be >= 0 or -1 (unlimited)")


@dataclass
class MasterConfig:
    """Everything the master reads at startup (``kvpool master --config``; flags
    of the same names override the file, see :mod:`kvpool.core.flags`)."""

    host: str = setting("127.0.0.1", help="bind address of the RPC socket (ZeroMQ ROUTER)")
    port: int = setting(50051, help="RPC port; 0 picks a free one")
    metrics_host: str = setting("127.0.0.1", help="bind address of the admin HTTP server")
    metrics_port: int = setting(
        9003, help="admin HTTP port (/metrics, /health); 0 disables the admin HTTP server")
    data_dir: str | None = setting(
        None, help="journal + snapshots directory (durability); null: no journal, state is lost "
        "on exit")
    lease_ttl_ms: int = setting(
        10000, help="read lease granted by get_replica_list / exist, milliseconds")
    soft_pin_ttl_ms: int = setting(
        30 * 60 * 1000, help="soft pin (ReplicateConfig soft_pin / SoftPinAction.ENABLE) of a "
        "put that names no TTL: the object is evicted after the unpinned ones until the pin "
        "expires")
    max_soft_pin_ttl_ms: int = setting(
        24 * 60 * 60 * 1000, help="longest soft pin a put may ask for")
    client_ttl_s: float = setting(
        10.0, help="a client silent this long is suspect: its segments take no new "
        "placements and keep their objects; it is back at its next ping")
    client_grace_s: float = setting(
        300.0, help="a suspect client whose guard process is silent too is dropped, with its "
        "objects, after client_ttl_s + this (its memory is presumed gone: a dead host, or a "
        "frozen cgroup that outlived the grace); an exit seen on its host unmounts at once")
    eviction_high_watermark: float = setting(
        0.9, help="evict when a pool (memory / file, separately) is this full")
    eviction_ratio: float = setting(
        0.05, help="eviction frees down to (watermark - ratio) of the pool's capacity")
    eviction_max_scan: int = setting(
        100000, help="objects examined per eviction round at most (bounds a stall)")
    eviction_batch: int = setting(
        2000, help="objects evicted per loop iteration (watermark eviction)")
    put_start_discard_timeout_s: float = setting(
        30.0, help="an in-flight put older than this may be preempted by a new put_start")
    put_start_release_timeout_s: float = setting(
        600.0, help="an in-flight put older than this is revoked (its space freed)")
    snapshot_interval_s: float = setting(
        300.0, help="periodic fuzzy snapshot (incremental, no fork); 0 disables "
        "(SIGUSR1 still snapshots)")
    snapshot_min_journal_records: int = setting(
        1, help="skip a periodic snapshot when fewer records were journaled since the last")
    snapshot_journal_records: int = setting(
        1_000_000, help="also snapshot once this many records were journaled since the last "
        "snapshot and at least as many as the directory holds objects (the journal then never "
        "outgrows a snapshot by much: disk use and restart time stay bounded whatever the "
        "write rate); a restart that replayed as many takes one at once; 0: time only")
    snapshot_keep: int = setting(2, help="snapshots kept (with the journals they need)")
    snapshot_slice_ms: float = setting(
        4.0, help="loop time per iteration spent serializing a snapshot")
    restore_slice_ms: float = setting(
        4.0, help="after a restart the master serves at once and makes the restored snapshot's "
        "objects in the background: loop time per iteration spent on it (one shard at least; a "
        "request loads the shards of its own keys first)")
    journal_fsync: FsyncPolicy = setting(
        FsyncPolicy.INTERVAL, help="always: fsync every group commit before its replies go out "
        "(survives power loss); interval: written before the replies (survives a master crash "
        "or kill -9), fsync'ed every journal_fsync_interval_ms; never: fsync left to the OS")
    journal_fsync_interval_ms: int = setting(100, help="fsync period of the interval policy")
    max_key_length: int = setting(4096, help="longer keys get INVALID_KEY")
    max_batch_size: int = setting(16384, help="larger batches get INVALID_PARAMS")
    max_frame_size: int = setting(
        64 * 1024 * 1024, size=True, help="larger request frames get FRAME_TOO_LARGE")
    max_object_size: int = setting(1 << 44, size=True, help="largest object accepted")
    max_replica_num: int = setting(
        16, help="replicas per tier at most (replica_num, disk_replica_num)")
    memory_alignment: int = setting(64, help="allocation alignment in MEMORY segments")
    file_alignment: int = setting(
        4096, help="allocation alignment in FILE segments (O_DIRECT)")
    expiry_slice: int = setting(64, help="segments dropped per loop iteration at most")
    purge_slice: int = setting(
        20000, help="objects purged from a dropped segment per loop iteration")
    log_level: str = setting(
        "INFO", cli=False,
        help="DEBUG, INFO, WARNING, ERROR (the command line's global --log-level wins)")
    capabilities: bool = setting(
        True, help="capability-checked data access (docs/security.md): a key per segment, "
        "handed to its owner at mount, and a signed READ/WRITE capability per granted replica, "
        "which the owner's transfer server verifies")
    capability_ttl_ms: int = setting(0, help="lifetime of a capability; 0 = lease_ttl_ms")
    max_inflight_per_client: int = setting(
        128, help="requests one connection may have queued in one loop pass; the excess gets "
        "TOO_MANY_REQUESTS (its ZeroMQ pipe is bounded too, so a flood stalls in TCP, not RAM)")
    local_socket: str = setting(
        "auto", help="same-host clients reach the master over a Unix socket served from its "
        "loop (kvpool.master.local_rpc): shorter round trips than ZeroMQ's "
        "(docs/BENCHMARKS.md). auto: $TMPDIR/kvpool-master-<uid>-<port>.sock, mode 0600, "
        "not opened when CURVE is on; off; or a path. Clients find it through "
        "Op.LOCAL_ENDPOINT after their first call (MasterClient(local=\"off\") opts out)")
    rpc_tcp: bool = setting(
        True, help="clients on other hosts: the same direct framing as the Unix socket on an "
        "ephemeral TCP port of host (announced through Op.LOCAL_ENDPOINT; shorter master "
        "round trips than ZeroMQ across hosts); never opened when CURVE is on")
    rpc_spin_us: int = setting(
        200, help="after answering, the loop polls without sleeping for up to this long while "
        "the next request has of late come that soon (a client's next one-key call: the next "
        "put's commit after its write), yielding the CPU between polls; a yield that comes "
        "back late (another task had the CPU: a busy host) pauses the polls for a while "
        "(kvpool.core.spin); 0 = always sleep in poll. On a VM whose idle vCPUs halt the "
        "polling keeps a vCPU awake for the next wake-up (docs/BENCHMARKS.md)")
    curve: CurveConfig = setting(
        default_factory=CurveConfig,
        help="authentication (ZeroMQ CURVE on the RPC socket; see docs/security.md)")
    tenant_keys: dict[str, list[str]] = setting(
        default_factory=dict, cli=False,
        help="who may act as which tenant (docs/tenants.md): {TENANT: [client public key, "
        "z85 or a *.key file, ...]}; when set, a request naming a tenant other than "
        "default is refused (PERMISSION_DENIED) unless its CURVE connection's key is listed "
        "for it (requests on the same-host socket act as default only); needs CURVE on")
    events_port: int = setting(
        0, help="object events for routers (docs/events.md): a ZeroMQ PUB socket on "
        "host:events_port (CURVE as the RPC socket) publishing stored/removed objects and "
        "segments after they are journaled, with a gap-free seq (LIST_OBJECTS is the resync "
        "listing); 0 = off")
    events_hwm: int = setting(
        10000, help="events queued per subscriber; a slower one misses messages (it sees a seq "
        "gap and resyncs); the master never waits")
    tiering: TieringConfig = setting(
        default_factory=TieringConfig,
        help="SSD tier (kvpool.master.tiering; nodes run `kvpool client --disk-dir DIR --disk "
        "SIZE`): offload on eviction, promotion, warm restart")
    etcd: str = setting(
        "", help="high availability (docs/ha.md): HOST:PORT[,HOST:PORT...] (or etcd://...) of "
        "an etcd cluster; instances with the same etcd and cluster_id elect one leader, the "
        "others replicate its journal. Empty: a single master")
    cluster_id: str = setting("default", help="name of the master group in etcd")
    advertise: str = setting(
        "", help="HOST:PORT clients reach this instance at (empty: host:port)")
    sync_standbys: int = setting(
        1, help="standbys that must hold a change before it is acknowledged")
    sync_timeout_s: float = setting(
        0.5, help="an in-sync standby silent this long is dropped from the in-sync set")
    ha_lease_ttl_s: int = setting(
        2, help="etcd lease TTL of the leader key: bounds failover and fencing time")
    replication_port: int = setting(
        0, help="port of the journal stream to the standbys (0: a free port)")
    replication_transport: ReplicationTransport = setting(
        ReplicationTransport.AUTO, help="journal stream to the standbys: socket (a plain TCP "
        "connection served on the leader's loop), zmq (ZeroMQ, needed for CURVE), auto (socket "
        "unless CURVE is active for host)")
    tenants: dict[str, Any] = setting(
        default_factory=dict, cli=False,
        help="per-tenant quotas (docs/tenants.md): {NAME: {memory: SIZE, disk: SIZE, "
        "guaranteed: SIZE}}; a missing limit = unlimited. Live changes (kvpool tenant set) are "
        "journaled and win over this file")
    default_tenant_quota: TenantQuota = setting(
        default_factory=TenantQuota, cli=False,
        help="the quota of a named tenant not listed in tenants (the default tenant is limited "
        "only when listed there)")

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
        for ok, what in (
                (self.client_ttl_s > 0, "client_ttl_s must be > 0"),
                (self.client_grace_s >= 0, "client_grace_s must be >= 0"),
                (all(0 <= p < 65536 for p in (self.port, self.metrics_port, self.events_port)),
                 "ports must be in [0, 65535]"),
                (0 <= self.soft_pin_ttl_ms <= self.max_soft_pin_ttl_ms,
                 "soft_pin_ttl_ms must be in [0, max_soft_pin_ttl_ms]"),
                (self.rpc_spin_us >= 0, "rpc_spin_us must be >= 0"),
                (self.capability_ttl_ms >= 0, "capability_ttl_ms must be >= 0 (0 = lease_ttl_ms)"),
                (self.snapshot_slice_ms > 0, "snapshot_slice_ms must be > 0"),
                (self.restore_slice_ms > 0, "restore_slice_ms must be > 0"),
                (self.snapshot_interval_s >= 0, "snapshot_interval_s must be >= 0"),
                (self.snapshot_journal_records >= 0, "snapshot_journal_records must be >= 0"),
                (self.sync_standbys >= 0, "sync_standbys must be >= 0"),
                (self.sync_timeout_s > 0, "sync_timeout_s must be > 0"),
                (self.ha_lease_ttl_s >= 1, "ha_lease_ttl_s must be >= 1"),
                (0 <= self.replication_port < 65536, "replication_port must be in [0, 65535]")):
            if not ok:
                raise ConfigError(what)
        if self.replication_transport is ReplicationTransport.SOCKET and curve_required(
                self.host, self.curve.enabled, self.curve.has_keys):
            raise ConfigError("replication_transport socket cannot carry CURVE, which is on "
                              f"for {self.host}: use auto or zmq")
        if self.tenant_keys:
            if not curve_required(self.host, self.curve.enabled, self.curve.has_keys):
                raise ConfigError("tenant_keys needs CURVE on (a key to bind a tenant to): "
                                  "set curve.enabled and a key (docs/security.md)")
            self.tenant_key_sets()  # raises on a bad name or key
        if self.etcd:
            from kvpool.core.etcd import parse_etcd_url

            try:
                parse_etcd_url(self.etcd, self.cluster_id or None)
            except ValueError as exc:
                raise ConfigError(f"etcd: {exc}") from None
        self.tiering.validate()
        if not isinstance(self.default_tenant_quota, TenantQuota):
            self.default_tenant_quota = load_dataclass(
                TenantQuota, self.default_tenant_quota or {}, prefix="default_tenant_quota.")
        self.default_tenant_quota.validate()
        self.tenants = tenant_quotas(self.tenants)

    def tenant_key_sets(self) -> dict[str, frozenset[str]]:
        """``tenant_keys`` resolved: tenant -> the z85 public keys (text, as
        ZeroMQ names a CURVE peer) that may act as it. ConfigError on a bad
        tenant name, key or key file."""
        out: dict[str, frozenset[str]] = {}
        if not isinstance(self.tenant_keys, dict):
            raise ConfigError("tenant_keys must map tenant names to lists of keys")
        for name, keys in self.tenant_keys.items():
            try:
                tenant = tenant_name(str(name))
            except KVPoolError as exc:
                raise ConfigError(f"tenant_keys: {exc}") from None
            if not isinstance(keys, list | tuple) or not keys:
                raise ConfigError(f"tenant_keys.{name}: expected a non-empty list of keys")
            out[tenant] = frozenset(_public_key_text(f"tenant_keys.{name}", k) for k in keys)
        return out


def tenant_quotas(tenants: Mapping[str, Any] | None) -> dict[str, TenantQuota]:
    """The ``tenants:`` mapping as canonical names -> :class:`TenantQuota`
    (sizes parsed); raises ConfigError on a bad name or limit."""
    quotas: dict[str, TenantQuota] = {}
    for name, q in (tenants or {}).items():
        try:
            canon = tenant_name(str(name))
        except KVPoolError as exc:
            raise ConfigError(f"tenants: {exc}") from None
        if not isinstance(q, TenantQuota):
            q = load_dataclass(TenantQuota, q or {}, prefix=f"tenants.{canon}.")
        q.validate()
        quotas[canon] = q
    return quotas


def _public_key_text(what: str, key: Any) -> str:
    """A z85 public key (40 characters) as it is, or the public key of a
    ``*.key`` file."""
    text = str(key)
    if len(text) == 40:
        try:
            if len(z85.decode(text)) == 32:
                return text
        except ValueError:
            pass
    try:
        return load_public_key(text).decode("ascii")
    except (OSError, KVPoolError, ValueError) as exc:
        raise ConfigError(f"{what}: {text!r} is neither a z85 public key nor a key file: "
                          f"{exc}") from None


def load_master_config(
    path: str | Path | Mapping[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> MasterConfig:
    """Defaults, then the YAML file (or mapping), then non-None ``overrides``."""
    return load_dataclass(MasterConfig, path, overrides)
