"""``kvpool master``: run the control plane."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

# flag -> (config key, type, help)
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--host", "host", str, "bind address of the RPC socket (default 127.0.0.1)"),
    ("--port", "port", int, "RPC port (default 50051; 0 picks a free one)"),
    ("--metrics-host", "metrics_host", str, "bind address of the admin HTTP server"),
    ("--metrics-port", "metrics_port", int, "admin HTTP port (default 9003; 0 disables)"),
    ("--data-dir", "data_dir", str, "journal + snapshots directory (durability)"),
    ("--events-port", "events_port", int,
     "publish object events (ZeroMQ PUB, docs/events.md) on this port (default 0: off)"),
    ("--lease-ttl-ms", "lease_ttl_ms", int, "read lease length (default 10000)"),
    ("--client-ttl-s", "client_ttl_s", float,
     "a client silent this long becomes suspect: no new placements (default 10)"),
    ("--client-grace-s", "client_grace_s", float,
     "a suspect client whose guard is silent too is dropped, with its objects, after this "
     "much more (default 300)"),
    ("--eviction-high-watermark", "eviction_high_watermark", float, "default 0.9"),
    ("--eviction-ratio", "eviction_ratio", float, "default 0.05"),
    ("--put-start-discard-timeout-s", "put_start_discard_timeout_s", float, "default 30"),
    ("--snapshot-interval-s", "snapshot_interval_s", float, "default 300; 0 disables"),
    ("--snapshot-keep", "snapshot_keep", int, "snapshots kept (default 2)"),
    ("--journal-fsync", "journal_fsync", str, "always | interval | never"),
    ("--max-key-length", "max_key_length", int, "default 4096"),
    ("--max-batch-size", "max_batch_size", int, "default 16384"),
    ("--max-frame-size", "max_frame_size", int, "default 64 MiB"),
    # high availability (docs/ha.md)
    ("--etcd", "etcd", str, "HOST:PORT[,HOST:PORT...] of etcd: run as one instance of an "
     "HA group (default: a single master)"),
    ("--cluster-id", "cluster_id", str, "HA group name in etcd (default 'default')"),
    ("--advertise", "advertise", str, "HOST:PORT clients reach this instance at"),
    ("--sync-standbys", "sync_standbys", int,
     "standbys that must hold a change before it is acknowledged (default 1)"),
]
# flag -> (``tiering:`` key, type, help): SSD-tier settings (kvpool.master.tiering_config)
_TIER_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--promote-after-hits", "promote_after_hits", int,
     "promote a disk-only object into memory at its Nth read from disk (default 2)"),
]


def register(subparsers: Any) -> None:
    """Add the ``master`` subcommand to the ``kvpool`` parser."""
    p = subparsers.add_parser("master", help="run the master (control plane)")
    from kvpool.core.auth import add_curve_arguments

    p.add_argument("--config", help="YAML config (configs/master.yaml documents the keys)")
    for flag, dest, tp, help_ in _FLAGS:
        p.add_argument(flag, dest=dest, type=tp, default=None, help=help_)
    for flag, key, tp, help_ in _TIER_FLAGS:
        p.add_argument(flag, dest=f"tiering_{key}", type=tp, default=None, metavar="N",
                       help=help_)
    add_curve_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the config, start the server, serve until SIGTERM/SIGINT."""
    from kvpool.core.auth import curve_config_from_args
    from kvpool.master.config import load_master_config
    from kvpool.master.server import MasterServer

    overrides: dict[str, Any] = {dest: getattr(args, dest, None) for _, dest, _, _ in _FLAGS}
    cfg = load_master_config(args.config, overrides)
    for _, key, _, _ in _TIER_FLAGS:
        value = getattr(args, f"tiering_{key}", None)
        if value is not None:
            setattr(cfg.tiering, key, value)
    cfg.tiering.validate()
    cfg.curve = curve_config_from_args(args, cfg.curve)
    if getattr(args, "log_level", "INFO") == "INFO":  # the global flag wins when given
        logging.getLogger().setLevel(cfg.log_level.upper())
    server = MasterServer(cfg)
    try:
        server.install_signal_handlers()
        server.serve_forever()
    finally:
        server.close()
    return 0
