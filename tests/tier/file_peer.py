"""Test helper process: owns one file segment and serves it through a
TransferEngine's transfer server (run as ``python tests/tier/file_peer.py``).

Prints one JSON line (the segment descriptor), then answers stdin commands,
one reply line each: ``crc OFF LEN`` -> ``ok <crc32>``, ``fill SEED`` ->
``ok`` (deterministic bytes over the whole segment), ``exit``.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib

import numpy as np

from kvpool.master.common import parse_size
from kvpool.transfer import TransferEngine, load_transfer_config
from kvpool.transfer.file_segment import FileSegment


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="16MiB")
    ap.add_argument("--segment-id", default=None)
    ap.add_argument("--host-id", default="file-peer-host")
    args = ap.parse_args()
    seg = FileSegment.open(args.dir, parse_size(args.size), args.segment_id)
    engine = TransferEngine(load_transfer_config(), args.host_id, client_id="file-peer")
    try:
        print(json.dumps(engine.add_local_segment(seg).to_wire()), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "crc":
                buf = np.empty(int(cmd[2]), np.uint8)
                seg.read_into(int(cmd[1]), buf)
                print("ok", zlib.crc32(buf.data), flush=True)
            elif cmd[0] == "fill":
                data = np.random.default_rng(int(cmd[1])).integers(0, 256, seg.size,
                                                                  dtype=np.uint8)
                seg.write_from(0, data)
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
