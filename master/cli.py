"""``kvpool master``: run the control plane."""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

def register(subparsers: Any) -> None:
    """Add the ``master`` subcommand to the ``kvpool`` parser: ``--config`` and
    one flag per :class:`~kvpool.master.config.MasterConfig` setting."""
    from kvpool.core.flags import add_config_flags
    from kvpool.master.config import MasterConfig

    p = subparsers.add_parser(
        "master", help="run the master (control plane)",
        description="Run the master. Flags override --config (configs/master.yaml).")
    p.add_argument("--config", help="YAML config (configs/master.yaml documents the keys)")
    add_config_flags(p, MasterConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the config, start the server, serve until SIGTERM/SIGINT."""
    from kvpool.core.flags import config_from_flags
    from kvpool.master.config import MasterConfig
    from kvpool.master.server import MasterServer

    cfg = config_from_flags(MasterConfig, args, args.config)
    if getattr(args, "log_level", None) is None:  # the global --log-level wins when given
        logging.getLogger().setLevel(cfg.log_level.upper())
    server = MasterServer(cfg)
    try:
        server.install_signal_handlers()
        server.serve_forever()
    finally:
        server.close()
    return 0
