"""Test helper process: owns one file segment and serves it through a
TransferEngine's transfer server (run as ``python tests/tier/file_peer.py``).

Prints one JSON line (the segment descriptor), then answers stdin commands,
one reply line each (support.peer.serve_stdin, shared with the
memory-segment peer): ``crc OFF LEN`` -> ``ok <crc32>``, ``fill SEED`` ->
``ok`` (deterministic bytes over the whole segment), ``exit``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from kvpool.core.config import parse_size
from kvpool.transfer import TransferEngine, load_transfer_config
from kvpool.transfer.file_segment import FileSegment
from support.peer import serve_stdin


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="16MiB")
    ap.add_argument("--segment-id", default=None)
    ap.add_argument("--host-id", default="file-peer-host")
    args = ap.parse_args()
    seg = FileSegment.open(args.dir, parse_size(args.size), args.segment_id)
    engine = TransferEngine(load_transfer_config(), args.host_id, client_id="file-peer")
    serve_stdin(engine, seg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
