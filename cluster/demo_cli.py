"""``kvpool demo``: a master + two node daemons on loopback and a KV-cache workload."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="run a local pool with a KV-cache-like workload",
        description="Start a master and two node daemons on loopback, run a KV-cache-like "
        "workload (chained prefix keys, 1-16 MiB values, prefix reuse, some 2-replica keys), "
        "print a summary, kill one daemon to show replicated keys survive, shut down.")
    p.add_argument("--requests", type=int, default=60, help="requests (prompts) to run")
    p.add_argument("--hit-rate", type=float, default=0.5,
                   help="probability a request continues an earlier prompt (0..1)")
    p.add_argument("--max-chunks", type=int, default=4, help="new chunks per request (max)")
    p.add_argument("--min-value", default="1MiB", help="smallest value (chunk) size")
    p.add_argument("--max-value", default="16MiB", help="largest value (chunk) size")
    p.add_argument("--memory", default="192MiB", help="memory per node daemon")
    p.add_argument("--replicated", type=float, default=0.3,
                   help="fraction of prompts stored with 2 replicas")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--system-chunks", type=int, default=4,
                   help="chunks of a shared system prompt (2 replicas, hard-pinned)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.cluster.demo import DemoConfig, run_demo
    from kvpool.core.config import ConfigError, parse_size

    cfg = DemoConfig(
        requests=args.requests, hit_rate=args.hit_rate, max_chunks=args.max_chunks,
        min_value=parse_size(args.min_value), max_value=parse_size(args.max_value),
        memory=parse_size(args.memory), replicated_fraction=args.replicated, seed=args.seed,
        system_chunks=args.system_chunks,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    if not (0 <= cfg.hit_rate <= 1 and 0 <= cfg.replicated_fraction <= 1):
        raise ConfigError("--hit-rate and --replicated must be within 0..1")
    if not (0 < cfg.min_value <= cfg.max_value <= cfg.memory) or cfg.requests < 1 \
            or cfg.max_chunks < 1:
        raise ConfigError("need 0 < min-value <= max-value <= memory, requests >= 1, "
                          "max-chunks >= 1")
    return run_demo(cfg)
