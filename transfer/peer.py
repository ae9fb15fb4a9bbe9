"""A standalone segment owner: ``python -m kvpool.transfer.peer``.

Creates one memory segment, serves it through a TransferEngine's transfer
server and prints one JSON line with the segment descriptor. Then it answers
line commands on stdin (one reply line each), for multi-process tests and
benchmarks:

- ``fill SEED``       fill the segment with deterministic bytes -> ``ok``
- ``crc OFF LEN``     crc32 of a range -> ``ok <crc>``
- ``stop-server``     close the transfer server (the process keeps the shm) -> ``ok``
- ``exit``            close everything and exit (the segment is unlinked)
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib

import numpy as np

from kvpool.master.common import parse_size
from kvpool.transfer.config import load_transfer_config
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.segment import MemorySegment

__all__ = ["fill_pattern", "main"]


def fill_pattern(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic pseudo-random bytes for ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segment-id", required=True)
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--host-id", default="peer-host")
    ap.add_argument("--client-id", default="peer")
    ap.add_argument("--no-prefault", action="store_true")
    ap.add_argument("--curve-key", default=None,
                    help="serve with ZeroMQ CURVE using this (cluster) *.key_secret")
    args = ap.parse_args(argv)
    curve = None
    if args.curve_key:
        from kvpool.master.auth import CurveConfig

        curve = CurveConfig(enabled=True, secret_key_file=args.curve_key)
    seg = MemorySegment.create(args.segment_id, parse_size(args.size),
                               prefault=not args.no_prefault)
    engine = TransferEngine(load_transfer_config(), args.host_id, client_id=args.client_id,
                            curve=curve)
    try:
        desc = engine.add_local_segment(seg)
        print(json.dumps(desc.to_wire()), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "fill":
                seg.array()[:] = fill_pattern(int(cmd[1]), seg.size)
                print("ok", flush=True)
            elif cmd[0] == "crc":
                off, n = int(cmd[1]), int(cmd[2])
                print("ok", zlib.crc32(seg.array()[off:off + n].data), flush=True)
            elif cmd[0] == "stop-server":
                if engine.server is not None:
                    engine.server.close()
                print("ok", flush=True)
            elif cmd[0] == "exit":
                break
            else:
                print("error unknown command", flush=True)
    finally:
        engine.close()
        seg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
