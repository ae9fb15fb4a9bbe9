"""``kvpool client``: the per-node daemon contributing memory (and disk)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "client",
        help="run a node daemon that contributes memory to the pool",
        description="Contribute memory (and disk) to the pool and serve transfers until "
        "SIGTERM, then unmount cleanly. Flags override --config (configs/client.yaml).",
    )
    p.add_argument("--master", default=None, help="master address HOST:PORT")
    p.add_argument("--memory", default=None, help="memory to contribute, e.g. 4GiB")
    p.add_argument("--host-id", default=None, help="host identity (default: hostname)")
    p.add_argument("--bind-host", default=None, help="transfer server address (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="transfer server port (0 = any)")
    p.add_argument("--segment-id", default=None,
                   help="segment id (default: <host-id>:<transfer port>)")
    p.add_argument("--disk-dir", default=None, help="directory for the SSD tier")
    p.add_argument("--disk", default=None, help="SSD tier size, e.g. 200GiB")
    p.add_argument("--no-prefault", action="store_true", help="do not pre-fault the segment")
    p.add_argument("--no-guard", action="store_true",
                   help="no guard process (it heartbeats while this process is stalled and "
                   "frees its shared memory if it dies)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics on 127.0.0.1:PORT (capability refusals; 0 = off)")
    p.add_argument("--config", default=None, help="client YAML (configs/client.yaml)")
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    from kvpool.core.auth import add_curve_arguments

    add_curve_arguments(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.core.config import parse_size
    from kvpool.store.config import load_client_config
    from kvpool.store.daemon import run_daemon

    overrides: dict[str, Any] = {
        "master_address": args.master,
        "memory_size": parse_size(args.memory) if args.memory is not None else None,
        "host_id": args.host_id,
        "bind_host": args.bind_host,
        "transfer_port": args.port,
        "segment_id": args.segment_id,
        "disk_dir": args.disk_dir,
        "disk_size": parse_size(args.disk) if args.disk is not None else None,
        "prefault": False if args.no_prefault else None,
        "guard": False if args.no_guard else None,
        "metrics_port": args.metrics_port,
    }
    from kvpool.core.auth import curve_config_from_args

    cfg = load_client_config(args.config, overrides)
    cfg.curve = curve_config_from_args(args, cfg.curve)
    return run_daemon(cfg, ready_file=args.ready_file)
