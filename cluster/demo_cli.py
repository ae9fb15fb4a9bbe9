"""``kvpool demo``: a master + two node daemons on loopback and a KV-cache workload."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand: one flag per :class:`DemoConfig` setting."""
    from kvpool.cluster.demo_config import DemoConfig
    from kvpool.core.flags import add_config_flags

    p = subparsers.add_parser(
        "demo", help="run a local pool with a KV-cache-like workload",
        description="Start a master and two node daemons on loopback, run a KV-cache-like "
        "workload (chained prefix keys, 1-16 MiB values, prefix reuse, some 2-replica keys), "
        "print a summary, kill one daemon to show replicated keys survive, shut down.")
    add_config_flags(p, DemoConfig)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.cluster.demo import run_demo
    from kvpool.cluster.demo_config import DemoConfig
    from kvpool.core.flags import config_from_flags

    return run_demo(config_from_flags(DemoConfig, args))
