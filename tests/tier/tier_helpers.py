"""Helpers shared by the SSD-tier tests (imported as ``tier_helpers``)."""

from __future__ import annotations

import os
import sys

import numpy as np

from support.peer import PeerProcess

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


class FilePeer(PeerProcess):
    """A child process owning a file segment (tests/tier/file_peer.py)."""

    def __init__(self, directory: str, size: int, host_id: str,
                 segment_id: str | None = None) -> None:
        cmd = [sys.executable, PEER_SCRIPT, "--dir", directory, "--size", str(size),
               "--host-id", host_id]
        if segment_id:
            cmd += ["--segment-id", segment_id]
        super().__init__(cmd, what="file peer")
