"""The ``kvpool`` console script: one subcommand per module.

Each subcommand module exposes ``register(subparsers) -> None`` which adds its
parser and sets ``func`` (a callable taking the parsed ``argparse.Namespace``
and returning an exit code). Subcommand modules must import their heavy
implementation lazily inside ``func`` so ``kvpool --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvpool.core import __version__
from kvpool.core.config import setup_logging
from kvpool.core.errors import KVPoolError

__all__ = ["SUBCOMMAND_MODULES", "build_parser", "main"]

log = logging.getLogger("kvpool")

# subcommand name -> module providing register(subparsers)
SUBCOMMAND_MODULES: dict[str, str] = {
    "master": "kvpool.master.cli",
    "client": "kvpool.store.daemon_cli",
    "status": "kvpool.cluster.status_cli",
    "tenant": "kvpool.cluster.tenant_cli",
    "demo": "kvpool.cluster.demo_cli",
    "keygen": "kvpool.cluster.keygen_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="kvpool: distributed KV-cache pool")
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING, ERROR (default: INFO, or the config's "
                        "log_level where it has one)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # subcommand not built yet
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.log_level or "INFO")
    try:
        return int(args.func(args) or 0)
    except KVPoolError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
