"""Fixtures for the transfer engine tests: real peer processes, engines, shm cleanup."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.transfer import MemorySegment, TransferEngine, load_transfer_config
from kvpool.transfer.peer import PeerProcess


class Peer(PeerProcess):
    """A ``python -m kvpool.transfer.peer`` child owning one shm segment."""

    def __init__(self, size: int, host_id: str = "host-test", segment_id: str | None = None,
                 prefault: bool = True) -> None:
        self.segment_id = segment_id or f"peer-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "kvpool.transfer.peer", "--segment-id", self.segment_id,
               "--size", str(size), "--host-id", host_id]
        if not prefault:
            cmd.append("--no-prefault")
        super().__init__(cmd, what="peer process")

    def close(self) -> None:
        super().close()
        # a killed peer cannot unlink its segment: clean up for it
        path = os.path.join("/dev/shm", self.desc.name)
        if os.path.exists(path):
            os.unlink(path)


@pytest.fixture
def make_peer() -> Iterator[Any]:
    peers: list[Peer] = []

    def factory(size: int = 1 << 20, **kw: Any) -> Peer:
        p = Peer(size, **kw)
        peers.append(p)
        return p

    yield factory
    for p in peers:
        p.close()


@pytest.fixture
def make_engine() -> Iterator[Any]:
    engines: list[TransferEngine] = []

    def factory(host_id: str = "host-test", overrides: dict[str, Any] | None = None,
                **kw: Any) -> TransferEngine:
        base: dict[str, Any] = {"transports": {"tcp": {"timeout_s": 3.0},
                                               "shm": {"timeout_s": 3.0}}}
        if overrides:
            for k, v in overrides.items():
                if k == "transports":
                    for t, s in v.items():
                        base["transports"].setdefault(t, {}).update(s)
                else:
                    base[k] = v
        e = TransferEngine(load_transfer_config(overrides=base), host_id, **kw)
        engines.append(e)
        return e

    yield factory
    for e in engines:
        e.close()


@pytest.fixture
def make_segment() -> Iterator[Any]:
    segs: list[MemorySegment] = []

    def factory(size: int = 1 << 20, segment_id: str | None = None) -> MemorySegment:
        s = MemorySegment.create(segment_id or f"local-{uuid.uuid4().hex[:8]}", size)
        segs.append(s)
        return s

    yield factory
    for s in segs:
        s.close()
        assert not os.path.exists(os.path.join("/dev/shm", s.name))
