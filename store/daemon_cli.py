"""``kvpool client``: the per-node daemon contributing memory (and disk)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``client`` subcommand: ``--config`` and one flag per
    :class:`~kvpool.store.config.ClientConfig` setting."""
    from kvpool.core.flags import add_config_flags
    from kvpool.store.config import ClientConfig

    p = subparsers.add_parser(
        "client",
        help="run a node daemon that contributes memory to the pool",
        description="Contribute memory (and disk) to the pool and serve transfers until "
        "SIGTERM, then unmount cleanly. Flags override --config (configs/client.yaml).",
    )
    p.add_argument("--config", default=None, help="client YAML (configs/client.yaml)")
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    add_config_flags(p, ClientConfig)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.core.flags import config_from_flags
    from kvpool.store.config import ClientConfig
    from kvpool.store.daemon import run_daemon

    cfg = config_from_flags(ClientConfig, args, args.config)
    return run_daemon(cfg, ready_file=args.ready_file)
