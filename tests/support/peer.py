"""A standalone segment owner for multi-process tests and benchmarks:
``python tests/support/peer.py`` (:data:`SCRIPT`).

Creates one memory segment, serves it through a TransferEngine's transfer
server and prints one JSON line with the segment descriptor. Then it answers
line commands on stdin (one reply line each):

- ``fill SEED``       fill the segment with deterministic bytes -> ``ok``
- ``crc OFF LEN``     crc32 of a range -> ``ok <crc>``
- ``stop-server``     close the transfer server (the process keeps the shm) -> ``ok``
- ``exit``            close everything and exit (the segment is unlinked)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np

from kvpool.core.config import parse_size
from kvpool.core.protocol import SegmentDescriptor
from kvpool.transfer.config import load_transfer_config
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.segment import LocalSegment, MemorySegment

__all__ = ["SCRIPT", "PeerProcess", "fill_pattern", "freeze", "main", "serve_stdin"]

#: the path to run this module as a script (it imports only kvpool)
SCRIPT = os.path.abspath(__file__)


def fill_pattern(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic pseudo-random bytes for ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def freeze(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: a thread
    busy polling a socket stops only at its next trip into the kernel, and
    may serve one more request meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just exited
                continue
        if all(st in "tT" for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")


def serve_stdin(engine: TransferEngine, seg: LocalSegment) -> None:
    """Add ``seg`` to ``engine``, print its descriptor as one JSON line, then answer
    the line commands of the module docstring on stdin until ``exit`` or EOF; in
    the end (also on error) close ``engine`` and then ``seg``. Shared by this peer
    (memory segment) and the tier tests' file-segment peer."""
    try:
        _serve_commands(engine, seg)
    finally:
        engine.close()
        seg.close()


def _serve_commands(engine: TransferEngine, seg: LocalSegment) -> None:
    desc = engine.add_local_segment(seg)
    print(json.dumps(desc.to_wire()), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fill":
            seg.write_from(0, fill_pattern(int(cmd[1]), seg.size))
            print("ok", flush=True)
        elif cmd[0] == "crc":
            off, n = int(cmd[1]), int(cmd[2])
            view = seg.view()
            if view is not None:
                print("ok", zlib.crc32(view[off:off + n]), flush=True)
            else:
                buf = np.empty(n, np.uint8)
                seg.read_into(off, buf)
                print("ok", zlib.crc32(buf.data), flush=True)
        elif cmd[0] == "stop-server":
            if engine.server is not None:
                engine.server.close()
            print("ok", flush=True)
        elif cmd[0] == "exit":
            break
        else:
            print("error unknown command", flush=True)


class PeerProcess:
    """The test side of a peer process speaking ``serve_stdin``'s protocol: spawn
    ``cmd``, read the descriptor line (``desc``), send commands (``cmd()``
    asserts an ``ok`` reply), ``close()`` (``exit``, SIGKILL if it hangs) or
    ``kill()`` (SIGKILL)."""

    def __init__(self, argv: list[str], what: str = "peer process") -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} died before printing its descriptor")
        self.desc = SegmentDescriptor.from_wire(json.loads(line))

    def cmd(self, text: str) -> list[str]:
        """Send one command line; return the words after ``ok`` (asserts ``ok``)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().split()
        assert reply and reply[0] == "ok", f"peer replied {reply!r} to {text!r}"
        return reply[1:]

    def crc(self, off: int, n: int) -> int:
        """crc32 of the segment's bytes ``[off, off+n)``."""
        return int(self.cmd(f"crc {off} {n}")[0])

    def kill(self) -> None:
        """SIGKILL and wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def close(self) -> None:
        """Ask it to exit (it closes its segment); SIGKILL if that fails."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segment-id", required=True)
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--host-id", default="peer-host")
    ap.add_argument("--client-id", default="peer")
    ap.add_argument("--no-prefault", action="store_true")
    ap.add_argument("--bulk-spin-us", type=int, default=0,
                    help="server.bulk_spin_us of the peer's transfer server")
    ap.add_argument("--curve-key", default=None,
                    help="serve with ZeroMQ CURVE using this (cluster) *.key_secret")
    args = ap.parse_args(argv)
    curve = None
    if args.curve_key:
        from kvpool.core.auth import CurveConfig

        curve = CurveConfig(enabled=True, secret_key_file=args.curve_key)
    seg = MemorySegment.create(args.segment_id, parse_size(args.size),
                               prefault=not args.no_prefault)
    overrides = {"server": {"bulk_spin_us": args.bulk_spin_us}} if args.bulk_spin_us else None
    engine = TransferEngine(load_transfer_config(overrides=overrides), args.host_id,
                            client_id=args.client_id, curve=curve)
    serve_stdin(engine, seg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
