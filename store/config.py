"""Configuration of the store client: :class:`ClientConfig` and :class:`ReplicateConfig`.

``ClientConfig`` loads from YAML (``configs/client.yaml`` documents every key)
with :func:`load_client_config`; size keys accept ``4GiB``, ``512MiB``, ``1GB``.

Entry points configured by a mapping (the Mooncake-compatible class, the vLLM
connector's extra config) build theirs with :func:`client_config_from_env`:
overrides over a YAML (by default the one named by ``KVPOOL_CONFIG``), with CURVE keys from the
directory named by ``KVPOOL_CURVE_KEY_DIR``, and a transfer-server address
reachable from a non-loopback master.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from kvpool.core.auth import CurveConfig, is_loopback
from kvpool.core.config import ConfigError, load_dataclass, load_yaml_mapping, setting
from kvpool.core.errors import KVPoolError
from kvpool.core.etcd import policy_address
from kvpool.core.rpc_client import RpcPollConfig
from kvpool.core.tenants import DEFAULT_TENANT, tenant_name

__all__ = [
    "CHECKSUM_ALGOS",
    "CONFIG_ENV",
    "CURVE_KEY_DIR_ENV",
    "DEFAULT_DUMMY_PORT",
    "ClientConfig",
    "ObjectDataType",
    "ReplicateConfig",
    "SoftPinAction",
    "client_config_from_env",
    "curve_config_from_key_dir",
    "default_host_id",
    "load_client_config",
    "local_address_towards",
]

CONFIG_ENV = "KVPOOL_CONFIG"  # a client YAML for entry points that take no file
CURVE_KEY_DIR_ENV = "KVPOOL_CURVE_KEY_DIR"  # directory holding cluster.key_secret
#: where a node daemon answers Mooncake standalone clients (mooncake_client's default port)
DEFAULT_DUMMY_PORT = 50052

CHECKSUM_ALGOS = ("none", "crc32", "xxhash", "auto")


def default_host_id() -> str:
    """The host id used when none is configured: this machine's hostname.

    Processes with the same host id are taken to share /dev/shm, so the
    transfer engine moves their bytes through shared memory.
    """
    return socket.gethostname() or "localhost"


@dataclass
class ClientConfig:
    """Everything a :class:`kvpool.store.Client` needs. See configs/client.yaml."""

    master_address: str = setting(
        "127.0.0.1:50051", flag="--master", help="master address HOST:PORT (or tcp://HOST:PORT)")
    tenant: str = setting(
        DEFAULT_TENANT, flag="--tenant",
        help="the tenant this client acts for (docs/tenants.md): every key it puts, reads, "
        "lists or removes is that tenant's (the same key in two tenants is two objects) and "
        "its puts count against that tenant's quota. 1-64 of [A-Za-z0-9._-]; default: the "
        "default tenant (what every client without the setting uses)")
    memory_size: int = setting(
        0, flag="--memory", size=True,
        help="memory contributed to the pool as one shared-memory segment "
        "(/dev/shm/kvpool-...), e.g. 4GiB; 0 = pure client (reads and writes others' segments "
        "only)")
    host_id: str | None = setting(
        None, help="host identity; processes with the same id share /dev/shm, so their "
        "transfers go through shared memory; null = this machine's hostname")
    bind_host: str = setting(
        "127.0.0.1", help="address the transfer server binds (serves remote peers)")
    transfer_port: int = setting(0, flag="--port", help="transfer server port; 0 = any free port")
    segment_id: str | None = setting(
        None, help="segment id; null = <host_id>:<transfer port> (what the Mooncake-compatible "
        "get_hostname() returns, usable as a preferred segment)")
    prefault: bool = setting(
        True, help="touch the segment at mount so peers copy into it at memcpy speed (fresh "
        "shm runs ~1 GB/s on first touch; costs ~0.9 s per GiB at startup)")
    disk_dir: str | None = setting(
        None, help="directory of the SSD tier's file segment (disk_size bytes)")
    disk_size: int = setting(0, flag="--disk", size=True, help="SSD tier size, e.g. 200GiB")
    transfer_config: str | None = setting(
        None, help="transfer-engine YAML over the built-in defaults (configs/transfer.yaml "
        "writes them out); null = the defaults")
    transfer_overrides: dict[str, Any] = setting(
        default_factory=dict, help="deep-merged over the transfer config, e.g. "
        "{rules: [{name: all-tcp, transports: [tcp]}]} forces tcp")
    rpc_timeout_s: float = setting(5.0, help="timeout of every master RPC, seconds")
    transfer_timeout_s: float = setting(
        30.0, help="timeout of every transfer batch, seconds (a read is also cut at its lease "
        "deadline)")
    ping_interval_s: float = setting(
        1.0, help="liveness ping period, seconds; the client re-mounts its segments when the "
        "master asks (e.g. after a master restart)")
    guard: bool = setting(
        True, help="a client that owns segments starts a guard process (python -m "
        "kvpool.store.guard, ~25MiB): it heartbeats for the client while the process is "
        "stalled (a call holding the GIL, a debugger, SIGSTOP), so the master keeps its segments "
        "and objects, and when the process dies however it dies (SIGTERM, kill -9) it removes "
        "its /dev/shm memory and unmounts it. false = no guard: a stall past the master's "
        "client_ttl_s marks the client suspect (objects kept for client_grace_s); a crash "
        "leaves its shared memory to the janitor of the next kvpool process on the host")
    checksum: str = setting(
        "none", help="checksum of values at put, verified at get: none | crc32 | xxhash | auto "
        "(xxhash if installed, else crc32)")
    verify_checksum: bool = setting(
        True, help="verify a recorded checksum on every get (host buffers)")
    inline_shm: bool = setting(
        True, help="deprecated, ignored: a same-host shared-memory copy runs on the "
        "calling thread whenever the caller waits for it (the transfer engine's one path)")
    split_first_locate: bool = setting(
        True, help="pipelined reads (batch_get_into_parts: the vLLM connector's loads) "
        "locate the first stage's keys by a master call of their own and the rest by a "
        "second call from a helper thread while the first stage moves; false = one call "
        "for all")
    curve: CurveConfig = setting(
        default_factory=CurveConfig,
        help="authentication (ZeroMQ CURVE towards the master and on/towards transfer "
        "servers; see docs/security.md). Entry points without flags (the Mooncake-compatible "
        "class, the vLLM connector) read this file from $KVPOOL_CONFIG and the cluster key "
        "from $KVPOOL_CURVE_KEY_DIR")
    rpc_poll: RpcPollConfig = setting(
        default_factory=RpcPollConfig,
        help="how the client's master RPC stubs poll for a reply before sleeping")
    reserve_single_puts: bool = setting(
        True, help="a single put (default options, no checksum, host buffer, at most "
        "reserve_max_bytes) asks its commit's reply for a reservation of the same size; the "
        "next put of that size writes into it and commits with one master call (PUT_COMMIT) "
        "instead of two (PUT_START, PUT_END). At most 8 sizes are held; close() gives them "
        "back")
    reserve_batch_puts: bool = setting(
        True, help="a batch put of values of one size (default options, no checksum, at "
        "most reserve_max_bytes in all) asks its commit's reply for reservations of the "
        "same shape; the next batch of that size and at most as many keys writes into them "
        "and commits with one master call (BATCH_PUT_COMMIT) instead of two "
        "(BATCH_PUT_START, BATCH_PUT_END). close() gives them back")
    reserve_max_bytes: int = setting(
        64 << 20, size=True,
        help="the largest put (bytes of all its values) that asks for reservations "
        "(reserve_single_puts, reserve_batch_puts). The reservations a client holds stay "
        "below 4x this in all (a put that would pass it asks for none); they are pool "
        "space held for its next puts until used, given back at close(), or swept by the "
        "master when their grant expires. Across hosts a large put saves a master round "
        "trip (docs/BENCHMARKS.md); 0 = no reservations")
    metrics_port: int = setting(
        0, help="node daemon: Prometheus /metrics (kvpool_node_*: segments, transfers "
        "served and made, capability refusals, guard, SSD tier; docs/metrics.md) and JSON "
        "/health on 127.0.0.1:PORT; 0 = off")
    dummy_port: int = setting(
        DEFAULT_DUMMY_PORT, flag="--dummy-port",
        help="node daemon: answer Mooncake standalone clients (setup_dummy(mem_pool_size, "
        "local_buffer_size, \"127.0.0.1:PORT\") in an engine process, as Mooncake's "
        "mooncake_client does) on 127.0.0.1:PORT: they learn the master, tenant, host id "
        "and this daemon's segment and leave the memory to it (docs/mooncake_compat.md). "
        "50052 is mooncake_client's default; when another process holds it already the "
        "daemon logs a warning and runs without (any other port taken is an error); 0 = off")

    def __post_init__(self) -> None:
        # checked at construction (not only by load_client_config's validate()):
        # a client must never start acting for a name the master would refuse
        try:
            self.tenant = tenant_name(self.tenant)
        except KVPoolError as exc:
            raise ConfigError(f"tenant: {exc.args[0]}") from None

    def validate(self) -> None:
        """Raise :class:`ConfigError` on values that cannot work."""
        if self.memory_size < 0 or self.disk_size < 0:
            raise ConfigError("memory_size and disk_size must be >= 0")
        if self.reserve_max_bytes < 0:
            raise ConfigError("reserve_max_bytes must be >= 0")
        if self.disk_size > 0 and not self.disk_dir:
            raise ConfigError("disk_size > 0 needs disk_dir")
        for name in ("rpc_timeout_s", "transfer_timeout_s", "ping_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.checksum not in CHECKSUM_ALGOS:
            raise ConfigError(f"checksum must be one of {', '.join(CHECKSUM_ALGOS)}")
        if not (0 <= self.transfer_port < 65536):
            raise ConfigError("transfer_port must be in 0..65535")
        if not (0 <= self.dummy_port < 65536):
            raise ConfigError("dummy_port must be in 0..65535")
        if not self.master_address:
            raise ConfigError("master_address is required")


def load_client_config(
    path: str | Path | Mapping[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> ClientConfig:
    """Load a :class:`ClientConfig` from YAML (or defaults) plus ``overrides``."""
    return load_dataclass(ClientConfig, path, overrides)


def curve_config_from_key_dir(directory: str | Path) -> dict[str, Any]:
    """The ``curve`` settings (a mapping) for a cluster-key directory.

    ``DIR/cluster.key_secret`` (``kvpool keygen --out DIR --name cluster``), or
    the only ``*.key_secret`` in ``DIR``, is this process's keypair, used as its
    server and client key (the cluster-key model: every member holds the same
    secret). ``*.key`` public keys in ``DIR`` are admitted as clients too.
    Raises :class:`ConfigError` when the directory holds no usable secret.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"{CURVE_KEY_DIR_ENV}={d}: not a directory")
    secret = d / "cluster.key_secret"
    if not secret.is_file():
        found = sorted(d.glob("*.key_secret"))
        if len(found) != 1:
            raise ConfigError(
                f"{CURVE_KEY_DIR_ENV}={d}: expected cluster.key_secret or exactly one "
                f"*.key_secret (found {len(found)}); run `kvpool keygen --out {d} --name cluster`")
        secret = found[0]
    out: dict[str, Any] = {"secret_key_file": str(secret)}
    if any(d.glob("*.key")):
        out["allowed_clients_dir"] = str(d)
    return out


def local_address_towards(address: str) -> str:
    """This host's source address for packets to ``address`` (``HOST:PORT``,
    ``tcp://HOST:PORT`` or a bare host): the address peers on that network can
    reach us at. Sends nothing (a UDP ``connect`` only consults the routing
    table). Falls back to 127.0.0.1 when there is no route."""
    host = address.split("://", 1)[-1]
    if host.startswith("["):
        host = host[1:host.find("]")]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def _curve_mapping(value: Any) -> dict[str, Any]:
    if isinstance(value, CurveConfig):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"curve: expected a mapping or CurveConfig, got {type(value).__name__}")


def client_config_from_env(overrides: Mapping[str, Any] | None = None, *,
                           path: str | Path | None = None,
                           environ: Mapping[str, str] | None = None) -> ClientConfig:
    """A :class:`ClientConfig` for entry points configured by a mapping rather
    than by flags (the Mooncake-compatible class, the vLLM connector).

    Layers, later wins: the defaults; the YAML at ``path``, else the one named
    by ``KVPOOL_CONFIG`` (if set); the CURVE keys of the directory named by ``KVPOOL_CURVE_KEY_DIR``
    (if set; see :func:`curve_config_from_key_dir`); ``overrides`` (any
    ``ClientConfig`` key, ``None`` values ignored; sizes may be strings such as
    ``"4GiB"``; ``curve`` a mapping, merged key by key, or a CurveConfig).
    When neither the YAML nor ``overrides`` sets ``bind_host`` and the master
    is not on loopback, the transfer server binds this host's address towards
    the master (:func:`local_address_towards`), so remote peers can reach it.
    CURVE's default (auto) is on off-loopback exactly when a key is configured.

    Raises :class:`ConfigError` (code CONFIG_ERROR) naming the bad key, file
    or directory.
    """
    env = os.environ if environ is None else environ
    mapping: dict[str, Any] = {}
    path = path or env.get(CONFIG_ENV, "")
    if path:
        mapping = load_yaml_mapping(path)
    curve = _curve_mapping(mapping.get("curve") or {})
    key_dir = env.get(CURVE_KEY_DIR_ENV, "")
    if key_dir:
        curve.update(curve_config_from_key_dir(key_dir))
    bind_explicit = "bind_host" in mapping
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k == "curve":
            curve.update(_curve_mapping(v))
            continue
        if k == "bind_host":
            bind_explicit = True
        mapping[k] = v
    if curve:
        mapping["curve"] = curve
    cfg = load_dataclass(ClientConfig, mapping)
    master = policy_address(cfg.master_address)  # a group: its etcd's network
    if not bind_explicit and not is_loopback(master) and _is_default_bind(cfg.bind_host):
        cfg.bind_host = local_address_towards(master)
    return cfg


def _is_default_bind(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class SoftPinAction(IntEnum):
    """Mooncake's soft-pin transition of a write (values as Mooncake's).

    PRESERVE keeps an existing object's soft pin (a new object is not
    pinned); ENABLE pins it (for ``soft_pin_ttl_ms`` when given); DISABLE
    unpins it.
    """

    def __str__(self) -> str:  # as pybind11 prints it: SoftPinAction.ENABLE
        return f"{type(self).__name__}.{self.name}"

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(IntEnum):
    """Mooncake's object data-type tag (accepted; kvpool does not use it)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


@dataclass
class ReplicateConfig:
    """How to place the replicas of one put.

    ``replica_num`` memory replicas on distinct segments (the master gives
    fewer when fewer segments exist); ``preferred_segments`` are tried first
    (``preferred_segment`` is Mooncake's single-segment spelling);
    ``with_hard_pin`` objects are never evicted, ``soft_pin`` ones last;
    ``disk_replica_num`` extra replicas on FILE segments (SSD tier).

    Mooncake's fields are accepted with its names and defaults:
    ``with_soft_pin`` (0.3.12; alias of ``soft_pin``), ``soft_pin_action`` /
    ``soft_pin_ttl_ms`` (0.3.13; ENABLE pins), ``nof_replica_num`` (kvpool's
    disk tier serves Mooncake's NVMe-oF replicas: added to
    ``disk_replica_num``), ``preferred_nof_segments``, ``dfs_replica_num``,
    ``prefer_alloc_in_same_node``, ``data_type`` and ``group_ids``; what
    each does on kvpool is in docs/mooncake_compat.md.
    """

    replica_num: int = 1
    preferred_segments: list[str] = field(default_factory=list)
    with_hard_pin: bool = False
    soft_pin: bool = False
    disk_replica_num: int = 0
    preferred_segment: str = ""
    nof_replica_num: int = 0
    dfs_replica_num: int = 0
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int | None = None
    preferred_nof_segments: list[str] = field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    data_type: ObjectDataType = ObjectDataType.UNKNOWN
    group_ids: list[str] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Mooncake binds soft_pin_ttl_ms as optional<uint64>: anything else is a TypeError
        if name == "soft_pin_ttl_ms" and value is not None and (
                isinstance(value, bool) or not isinstance(value, int)
                or not 0 <= value < 1 << 64):
            raise TypeError(f"soft_pin_ttl_ms must be None or an unsigned 64-bit int: {value!r}")
        if name == "soft_pin_action" and not isinstance(value, SoftPinAction):
            value = SoftPinAction(value)
        object.__setattr__(self, name, value)

    # Mooncake 0.3.12's name for soft_pin.
    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin = bool(value)

    @property
    def pins_soft(self) -> bool:
        """Whether a write with this config soft-pins its object."""
        return self.soft_pin or self.soft_pin_action == SoftPinAction.ENABLE

    def mooncake_error(self, keys: int = 1) -> str | None:
        """Why Mooncake would refuse this config for a write of ``keys`` objects
        (INVALID_PARAMS), or None."""
        if self.soft_pin_ttl_ms is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            return "soft_pin_ttl_ms needs soft_pin_action ENABLE"
        if self.dfs_replica_num not in (0, 1):
            return "dfs_replica_num must be 0 or 1"
        if self.dfs_replica_num and self.replica_num < 1:
            return "dfs_replica_num needs replica_num >= 1"
        if self.prefer_alloc_in_same_node and self.replica_num != 1:
            return "prefer_alloc_in_same_node needs replica_num == 1"
        if self.group_ids is not None and len(self.group_ids) != keys:
            return f"group_ids has {len(self.group_ids)} entries for {keys} keys"
        if self.replica_num < 0 or self.nof_replica_num < 0 or self.disk_replica_num < 0:
            return "replica counts must be >= 0"
        return None

    def __str__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, "
                f"disk_replica_num={self.disk_replica_num + self.nof_replica_num}, "
                f"hard_pin={self.with_hard_pin}, soft_pin={self.pins_soft}, "
                f"preferred_segments={self.segments()})")

    def segments(self) -> list[str]:
        """Preferred segment ids, ``preferred_segment`` first, without duplicates."""
        out: list[str] = []
        for s in ([self.preferred_segment] if self.preferred_segment else []) + list(
            self.preferred_segments
        ) + list(self.preferred_nof_segments):
            if s and s not in out:
                out.append(s)
        return out

    def to_args(self) -> dict[str, Any]:
        """The PUT_START arguments this config stands for."""
        return {
            "replica_num": int(self.replica_num),
            "preferred_segments": self.segments(),
            "hard_pin": bool(self.with_hard_pin),
            "soft_pin": bool(self.pins_soft),
            "disk_replica_num": int(self.disk_replica_num) + int(self.nof_replica_num),
        }
