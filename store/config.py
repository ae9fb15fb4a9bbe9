"""Configuration of the store client: :class:`ClientConfig` and :class:`ReplicateConfig`.

``ClientConfig`` loads from YAML (``configs/client.yaml`` documents every key)
with :func:`load_client_config`; size keys accept ``4GiB``, ``512MiB``, ``1GB``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.core.auth import CurveConfig
from kvpool.core.config import ConfigError, load_dataclass

__all__ = [
    "CHECKSUM_ALGOS",
    "ClientConfig",
    "ReplicateConfig",
    "default_host_id",
    "load_client_config",
]

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

    master_address: str = "127.0.0.1:50051"
    memory_size: int = 0  # bytes contributed to the pool (0 = pure client)
    host_id: str | None = None  # None -> hostname; equal ids share memory via shm
    bind_host: str = "127.0.0.1"  # address of this process's transfer server
    transfer_port: int = 0  # 0 = any free port
    segment_id: str | None = None  # None -> "<host_id>:<transfer port>"
    prefault: bool = True  # touch the segment at mount so peers copy at memcpy speed
    # SSD tier (issue 5): a FILE segment of disk_size bytes under disk_dir.
    disk_dir: str | None = None
    disk_size: int = 0
    transfer_config: str | None = None  # transfer YAML (None = configs/transfer.yaml defaults)
    transfer_overrides: dict[str, Any] = field(default_factory=dict)
    rpc_timeout_s: float = 5.0  # every master RPC
    transfer_timeout_s: float = 30.0  # every transfer batch (also capped by the read lease)
    ping_interval_s: float = 1.0  # liveness ping; re-mounts when the master asks
    # segment owners: a guard process heartbeats while this process is stalled
    # and frees its segments when it dies (kvpool.store.guard)
    guard: bool = True
    checksum: str = "none"  # none | crc32 | xxhash | auto (xxhash if installed, else crc32)
    verify_checksum: bool = True  # verify a recorded checksum on every get (host buffers)
    inline_shm: bool = True  # same-host shm copies inline, without the engine's thread hop
    # ZeroMQ CURVE towards the master and on/towards transfer servers (docs/security.md):
    # auto = off for loopback addresses, required for any other
    curve: CurveConfig = field(default_factory=CurveConfig)
    # node daemon only: Prometheus /metrics on 127.0.0.1:metrics_port (0 = off):
    # capability refusals by reason, transfer server counters
    metrics_port: int = 0

    def validate(self) -> None:
        """Raise :class:`ConfigError` on values that cannot work."""
        if self.memory_size < 0 or self.disk_size < 0:
            raise ConfigError("memory_size and disk_size must be >= 0")
        if self.disk_size > 0 and not self.disk_dir:
            raise ConfigError("disk_size > 0 needs disk_dir")
        for name in ("rpc_timeout_s", "transfer_timeout_s", "ping_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.checksum not in CHECKSUM_ALGOS:
            raise ConfigError(f"checksum must be one of {', '.join(CHECKSUM_ALGOS)}")
        if not (0 <= self.transfer_port < 65536):
            raise ConfigError("transfer_port must be in 0..65535")
        if not self.master_address:
            raise ConfigError("master_address is required")


def load_client_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> ClientConfig:
    """Load a :class:`ClientConfig` from YAML (or defaults) plus ``overrides``."""
    return load_dataclass(ClientConfig, path, overrides)


@dataclass
class ReplicateConfig:
    """How to place the replicas of one put.

    ``replica_num`` memory replicas on distinct segments (the master gives
    fewer when fewer segments exist); ``preferred_segments`` are tried first
    (``preferred_segment`` is Mooncake's single-segment spelling);
    ``with_hard_pin`` objects are never evicted, ``soft_pin`` ones last;
    ``disk_replica_num`` extra replicas on FILE segments (SSD tier).
    """

    replica_num: int = 1
    preferred_segments: list[str] = field(default_factory=list)
    with_hard_pin: bool = False
    soft_pin: bool = False
    disk_replica_num: int = 0
    preferred_segment: str = ""

    # Mooncake's name for soft_pin.
    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin = bool(value)

    def segments(self) -> list[str]:
        """Preferred segment ids, ``preferred_segment`` first, without duplicates."""
        out: list[str] = []
        for s in ([self.preferred_segment] if self.preferred_segment else []) + list(
            self.preferred_segments
        ):
            if s and s not in out:
                out.append(s)
        return out

    def to_args(self) -> dict[str, Any]:
        """The PUT_START arguments this config stands for."""
        return {
            "replica_num": int(self.replica_num),
            "preferred_segments": self.segments(),
            "hard_pin": bool(self.with_hard_pin),
            "soft_pin": bool(self.soft_pin),
            "disk_replica_num": int(self.disk_replica_num),
        }

    def to_wire_args(self) -> dict[str, Any]:
        """:meth:`to_args` without the op table's defaults (smaller frames on the hot path)."""
        defaults = {"replica_num": 1, "preferred_segments": [], "hard_pin": False,
                    "soft_pin": False, "disk_replica_num": 0}
        return {k: v for k, v in self.to_args().items() if v != defaults[k]}
