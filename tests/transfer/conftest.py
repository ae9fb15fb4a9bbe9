"""Fixtures for the transfer engine tests: real peer processes, engines, shm cleanup."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.transfer import MemorySegment, TransferEngine, load_transfer_config
from support.cuda_double import cuda_double  # noqa: F401 (a fixture of the GPU-path tests)
from support.factories import closing_factory
from support.peer import SCRIPT as PEER_SCRIPT
from support.peer import PeerProcess


class Peer(PeerProcess):
    """A ``tests/support/peer.py`` child owning one shm segment."""

    def __init__(self, size: int, host_id: str = "host-test", segment_id: str | None = None,
                 prefault: bool = True, bulk_spin_us: int = 0) -> None:
        self.segment_id = segment_id or f"peer-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, PEER_SCRIPT, "--segment-id", self.segment_id,
               "--size", str(size), "--host-id", host_id]
        if not prefault:
            cmd.append("--no-prefault")
        if bulk_spin_us:
            cmd += ["--bulk-spin-us", str(bulk_spin_us)]
        super().__init__(cmd, what="peer process")

    def close(self) -> None:
        super().close()
        # a killed peer cannot unlink its segment: clean up for it
        path = os.path.join("/dev/shm", self.desc.name)
        if os.path.exists(path):
            os.unlink(path)


@pytest.fixture
def make_peer() -> Iterator[Any]:
    with closing_factory(lambda size=1 << 20, **kw: Peer(size, **kw)) as make:
        yield make


def _engine(host_id: str = "host-test", overrides: dict[str, Any] | None = None,
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
    return TransferEngine(load_transfer_config(overrides=base), host_id, **kw)


@pytest.fixture
def make_engine() -> Iterator[Any]:
    with closing_factory(_engine) as make:
        yield make


def _close_segment(s: MemorySegment) -> None:
    s.close()
    assert not os.path.exists(os.path.join("/dev/shm", s.name))


@pytest.fixture
def make_segment() -> Iterator[Any]:
    def create(size: int = 1 << 20, segment_id: str | None = None) -> MemorySegment:
        return MemorySegment.create(segment_id or f"local-{uuid.uuid4().hex[:8]}", size)

    with closing_factory(create, _close_segment) as make:
        yield make
