"""``kvpool keygen``: create a ZeroMQ CURVE keypair for kvpool's sockets."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``keygen`` subcommand to the ``kvpool`` parser."""
    p = subparsers.add_parser(
        "keygen",
        help="create a CURVE keypair (NAME.key public, NAME.key_secret mode 0600)",
        description="Create a ZeroMQ CURVE keypair. Give NAME.key_secret to every process "
        "that uses it (--curve-key) and NAME.key to those that only need the public key "
        "(--curve-server-key, or into an --curve-allow-dir). See docs/security.md.",
    )
    p.add_argument("--out", required=True, help="directory to write the key files into")
    p.add_argument("--name", default="cluster", help="file name stem (default: cluster)")
    p.add_argument("--force", action="store_true", help="overwrite existing key files")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the keypair; print the two paths and the public key."""
    from kvpool.core.auth import save_keypair

    pub, sec = save_keypair(args.out, args.name, overwrite=args.force)
    public = pub.read_text().split('public-key = "', 1)[1].split('"', 1)[0]
    print(f"public key:  {pub}\nsecret key:  {sec} (mode 0600)\n{public}")
    return 0
