"""Helpers shared by the SSD-tier tests (imported as ``tier_helpers``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np

from kvpool.master.protocol import SegmentDescriptor

__all__ = ["FilePeer", "aligned_empty", "pattern"]

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "file_peer.py")


def pattern(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic pseudo-random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def aligned_empty(n: int, align: int = 4096) -> np.ndarray:
    """A uint8 array of ``n`` bytes whose address is ``align``-aligned."""
    raw = np.empty(n + align, np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip:skip + n]


class FilePeer:
    """A child process owning a file segment (tests/tier/file_peer.py)."""

    def __init__(self, directory: str, size: int, host_id: str,
                 segment_id: str | None = None) -> None:
        cmd = [sys.executable, PEER_SCRIPT, "--dir", directory, "--size", str(size),
               "--host-id", host_id]
        if segment_id:
            cmd += ["--segment-id", segment_id]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("file peer died before printing its descriptor")
        self.desc = SegmentDescriptor.from_wire(json.loads(line))

    def cmd(self, text: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().split()
        assert reply and reply[0] == "ok", f"peer replied {reply!r} to {text!r}"
        return reply[1:]

    def crc(self, off: int, n: int) -> int:
        return int(self.cmd(f"crc {off} {n}")[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(5)
