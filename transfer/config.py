"""Transfer engine configuration: selector rules and per-transport settings.

Built by :func:`load_transfer_config` from the defaults written here (the
dataclasses, :data:`DEFAULT_RULES`, :data:`TRANSPORT_DEFAULTS`), an optional
YAML and overrides; ``configs/transfer.yaml`` documents every key with its
default (tests/core/test_config_docs.py keeps the two equal). Unknown keys and
impossible rules (unknown transport name, empty transport list, min_size >
max_size, bad enum values) raise ``ConfigError`` at startup.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.core.config import ConfigError, load_dataclass, load_yaml_mapping, parse_size
from kvpool.core.protocol import SegmentKind
from kvpool.transfer.transports import TRANSPORT_CLASSES

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_RULES",
    "TRANSPORT_DEFAULTS",
    "RuleConfig",
    "ServerConfig",
    "TransferConfig",
    "TransportSettings",
    "load_transfer_config",
]

#: The documented defaults in a source checkout (loading it changes nothing).
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "transfer.yaml"


def _size(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None:
        if allow_none:
            return None
        raise ConfigError(f"{name}: a size is required")
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from exc


def auto_threads() -> int:
    """``threads: auto``: half the CPUs this process may run on, from 2 to 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 2
    return max(2, min(8, cpus // 2))


@dataclass
class TransportSettings:
    """Settings of one transport (``transports.<name>`` in the YAML).

    ``enabled``: true (must be available, else ConfigError at startup), false,
    or auto (used when available). ``timeout_s``: deadline of one sub-batch
    attempt. ``retries``: extra attempts on the same transport before failing
    over. ``threads``: worker threads (parallel slices of a sub-batch; a
    large lone tcp request is striped over as many connections); ``auto``:
    half the CPUs this process may run on, from 2 to 8 (each stream's copy
    in the kernel takes a core: one or two streams leave a many-core host's
    link half used, and more than the cores only contend).
    ``chunk_size``: unit of pipelining (tcp). ``window``: chunks in flight per
    connection (tcp). ``staging_buffers``/``staging_size``: pinned host pool for
    GPU staging. ``pause_after_failures``: consecutive failed attempts that
    pause the transport for ``cooldown_s``. ``inline_max_bytes``: a sub-batch
    of at most this many bytes runs in the submitting thread (no thread hop;
    ``run()`` and ``transfer()`` run any single-slice sub-batch there).
    ``options``: free-form extras of transports added later (e.g. ``o_direct``
    for posix).
    """

    enabled: bool | str = "auto"
    timeout_s: float = 30.0
    retries: int = 0
    threads: int | str = 1
    chunk_size: int | str = 4 << 20
    window: int = 8
    staging_buffers: int = 8
    staging_size: int | str = 4 << 20
    pause_after_failures: int = 3
    cooldown_s: float = 5.0
    inline_max_bytes: int | str = 0
    options: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if isinstance(self.enabled, str):
            if self.enabled.lower() not in ("auto", "true", "false"):
                raise ConfigError(f"enabled: {self.enabled!r} is not one of true, false, auto")
            low = self.enabled.lower()
            self.enabled = "auto" if low == "auto" else low == "true"
        self.chunk_size = _size("chunk_size", self.chunk_size) or 0
        self.staging_size = _size("staging_size", self.staging_size) or 0
        self.inline_max_bytes = _size("inline_max_bytes", self.inline_max_bytes) or 0
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0: {self.timeout_s}")
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0: {self.retries}")
        if isinstance(self.threads, str):
            if self.threads.lower() != "auto":
                raise ConfigError(f"threads: {self.threads!r} is neither a number nor auto")
            self.threads = auto_threads()
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1: {self.threads}")
        if self.chunk_size < 4096:
            raise ConfigError(f"chunk_size must be >= 4096: {self.chunk_size}")
        if self.window < 1 or self.staging_buffers < 1:
            raise ConfigError("window and staging_buffers must be >= 1")
        if self.staging_size < 4096:
            raise ConfigError(f"staging_size must be >= 4096: {self.staging_size}")
        if self.pause_after_failures < 1 or self.cooldown_s < 0:
            raise ConfigError("pause_after_failures must be >= 1 and cooldown_s >= 0")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_size)

    @property
    def staging_bytes(self) -> int:
        return int(self.staging_size)


@dataclass
class RuleConfig:
    """One selector rule; the first matching rule gives the transport order.

    ``kind``: memory | file | any. ``same_host``: true | false | any.
    ``device``: cpu | cuda | any (the caller buffer's device).
    ``min_size``/``max_size``: request length range, inclusive (max null = no limit).
    ``transports``: ordered list of transport names.
    """

    transports: list[str] = field(default_factory=list)
    name: str = ""
    kind: str = "any"
    same_host: bool | str = "any"
    device: str = "any"
    min_size: int | str = 0
    max_size: int | str | None = None

    def validate(self) -> None:
        label = f"rule {self.name!r}" if self.name else "rule"
        self.kind = self.kind.lower()
        if self.kind not in ("memory", "file", "any"):
            raise ConfigError(f"{label}: kind {self.kind!r} is not one of memory, file, any")
        if isinstance(self.same_host, str):
            low = self.same_host.lower()
            if low not in ("any", "true", "false"):
                raise ConfigError(f"{label}: same_host {self.same_host!r} is not true/false/any")
            self.same_host = "any" if low == "any" else low == "true"
        self.device = self.device.lower()
        if self.device not in ("cpu", "cuda", "any"):
            raise ConfigError(f"{label}: device {self.device!r} is not one of cpu, cuda, any")
        self.min_size = _size(f"{label}.min_size", self.min_size) or 0
        self.max_size = _size(f"{label}.max_size", self.max_size, allow_none=True)
        if self.max_size is not None and self.min_size > self.max_size:
            raise ConfigError(f"{label}: min_size {self.min_size} > max_size {self.max_size}")
        if not self.transports:
            raise ConfigError(f"{label}: empty transport list")
        if len(set(self.transports)) != len(self.transports):
            raise ConfigError(f"{label}: duplicate transport in {self.transports}")

    def matches(self, kind: SegmentKind, same_host: bool, device: str, size: int) -> bool:
        if self.kind != "any" and self.kind != ("memory" if kind == SegmentKind.MEMORY else "file"):
            return False
        if self.same_host != "any" and self.same_host != same_host:
            return False
        if self.device != "any" and self.device != device:
            return False
        if size < int(self.min_size):
            return False
        return not (self.max_size is not None and size > int(self.max_size))


@dataclass
class ServerConfig:
    """The transfer server (``server:`` in the YAML).

    ``enabled``: start it in TransferEngine.__init__. ``max_request_bytes``:
    largest single READ/WRITE frame it accepts (clients chunk below it).
    ``max_header_bytes``: largest header frame. ``io_threads``: ZeroMQ I/O threads.
    ``capabilities`` (docs/security.md): ``auto`` = verify every READ/WRITE of a segment
    once the master handed over its key (the normal case), ``on`` = always
    (a segment without a key refuses everything), ``off`` = never.
    ``capability_leeway_ms``: clock skew tolerated on expiry.
    ``max_queued_requests``: requests one peer connection may have queued
    (ZeroMQ receive high-water mark): beyond it the server stops reading that
    peer's socket (TCP back-pressure) instead of buffering without bound.
    ``bulk_spin_us``: after answering on a bulk connection, its thread polls
    for the peer's next request without sleeping for up to this long, while
    that peer's requests have of late come that soon (a client's next get
    after its next master call); 0 = always sleep (:mod:`kvpool.core.spin`).
    """

    enabled: bool = True
    max_request_bytes: int | str = 64 << 20
    max_header_bytes: int = 4096
    io_threads: int = 1
    capabilities: str = "auto"
    capability_leeway_ms: int = 2000
    max_queued_requests: int = 64
    #: also serve READ/WRITE payloads over a plain TCP socket that reads/writes
    #: them in place (kvpool.transfer.bulk; one copy less than ZeroMQ). Never
    #: opened when the server uses CURVE.
    bulk: bool = True
    bulk_spin_us: int = 0

    def validate(self) -> None:
        if self.bulk_spin_us < 0:
            raise ConfigError(f"server.bulk_spin_us must be >= 0: {self.bulk_spin_us}")
        if self.capabilities not in ("auto", "on", "off"):
            raise ConfigError(f"server.capabilities must be auto, on or off: "
                              f"{self.capabilities!r}")
        if self.capability_leeway_ms < 0 or self.max_queued_requests < 1:
            raise ConfigError("server: capability_leeway_ms >= 0, max_queued_requests >= 1")
        self.max_request_bytes = _size("server.max_request_bytes", self.max_request_bytes) or 0
        if self.max_request_bytes < 4096 or self.max_header_bytes < 256 or self.io_threads < 1:
            raise ConfigError("server: max_request_bytes >= 4096, max_header_bytes >= 256, "
                              "io_threads >= 1")


@dataclass
class TransferConfig:
    """Whole transfer-engine config. See configs/transfer.yaml.

    ``tcp_congestion``: the TCP congestion control of the bulk sockets, both
    ends (:func:`kvpool.transfer.bulk.set_congestion`): ``auto`` = a socket the
    host gives BBR is moved to cubic (reno where cubic is not allowed), any
    other algorithm is kept; ``system`` = the host's choice; or the name of
    an algorithm. BBR paces a reply's segments at its estimate of the path's
    rate, and request/response traffic with idle gaps keeps that estimate
    far too low: a 128 KiB batch reply across a veth waited 20-40 ms between
    its two 64 KiB segments in half the runs (docs/BENCHMARKS.md).
    """

    max_failover: int = 2
    rules: list[RuleConfig] = field(default_factory=list)
    transports: dict[str, TransportSettings] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)
    tcp_congestion: str = "auto"

    def validate(self) -> None:
        if self.max_failover < 0:
            raise ConfigError(f"max_failover must be >= 0: {self.max_failover}")
        if not re.fullmatch(r"[a-z0-9_]{1,15}", self.tcp_congestion):
            raise ConfigError(f"tcp_congestion must be auto, system or an algorithm's name: "
                              f"{self.tcp_congestion!r}")
        if not self.rules:
            raise ConfigError("no selector rules")
        for rule in self.rules:
            for t in rule.transports:
                if t not in TRANSPORT_CLASSES and t not in self.transports:
                    raise ConfigError(
                        f"rule {rule.name!r}: unknown transport {t!r} "
                        f"(known: {', '.join(sorted(TRANSPORT_CLASSES))})"
                    )

    def settings_for(self, name: str) -> TransportSettings:
        """The settings of transport ``name`` (defaults if it has no section)."""
        s = self.transports.get(name)
        if s is None:
            s = TransportSettings()
            s.validate()
            self.transports[name] = s
        return s


def _build(mapping: Mapping[str, Any]) -> TransferConfig:
    data = dict(mapping)
    raw_transports = data.pop("transports", None) or {}
    if not isinstance(raw_transports, Mapping):
        raise ConfigError("transports: expected a mapping of name -> settings")
    transports: dict[str, TransportSettings] = {}
    for name, section in raw_transports.items():
        if str(name) not in TRANSPORT_CLASSES:
            raise ConfigError(
                f"transports.{name}: unknown transport "
                f"(known: {', '.join(sorted(TRANSPORT_CLASSES))})"
            )
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"transports.{name}: expected a mapping")
        transports[str(name)] = load_dataclass(TransportSettings, section,
                                               prefix=f"transports.{name}.")
    cfg = load_dataclass(TransferConfig, {**data, "transports": {}})
    cfg.transports = transports
    cfg.validate()
    return cfg


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if v is None:
            continue
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "options":
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_transfer_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> TransferConfig:
    """The built-in defaults (:data:`DEFAULT_RULES`, :data:`TRANSPORT_DEFAULTS`,
    the dataclass defaults; configs/transfer.yaml writes them all out), the YAML
    at ``path`` deep-merged over them (``rules`` replaces the list, a
    ``transports.<name>`` section merges key by key), then ``overrides`` the
    same way (e.g. ``{"transports": {"tcp": {"timeout_s": 2}}}``). Raises
    ``ConfigError`` on any invalid key or value."""
    data: dict[str, Any] = {"rules": DEFAULT_RULES,
                            "transports": {k: dict(v) for k, v in TRANSPORT_DEFAULTS.items()}}
    if path is not None:
        data = _deep_merge(data, load_yaml_mapping(path))
    if overrides:
        data = _deep_merge(data, overrides)
    return _build(data)


#: The selector's rules unless a config gives its own ``rules``.
DEFAULT_RULES: list[dict[str, Any]] = [
    {"name": "local-memory", "kind": "memory", "same_host": True, "transports": ["shm", "tcp"]},
    {"name": "remote-memory", "kind": "memory", "same_host": False,
     "transports": ["rdma", "tcp"]},
    {"name": "local-file-gpu", "kind": "file", "same_host": True, "device": "cuda",
     "transports": ["gds", "posix", "tcp"]},
    {"name": "local-file", "kind": "file", "same_host": True,
     "transports": ["posix", "gds", "tcp"]},
    {"name": "remote-file", "kind": "file", "same_host": False, "transports": ["tcp"]},
]

#: Per-transport settings that differ from :class:`TransportSettings`' defaults.
TRANSPORT_DEFAULTS: dict[str, dict[str, Any]] = {
    "shm": {"inline_max_bytes": 256 << 10},  # a memcpy this small costs less than a thread hop
    "tcp": {"retries": 1, "threads": "auto"},
    "rdma": {"threads": 2, "staging_size": 1 << 20},
}
