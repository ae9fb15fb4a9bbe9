"""Fixtures for the SSD-tier tests: engines and real peer processes owning
file segments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tier_helpers import FilePeer

from kvpool.transfer import TransferEngine, load_transfer_config


@pytest.fixture
def make_file_peer() -> Iterator[Any]:
    peers: list[FilePeer] = []

    def factory(directory: str, size: int = 8 << 20, host_id: str = "file-peer-host",
                **kw: Any) -> FilePeer:
        p = FilePeer(directory, size, host_id, **kw)
        peers.append(p)
        return p

    yield factory
    for p in peers:
        p.close()


@pytest.fixture
def make_engine() -> Iterator[Any]:
    engines: list[TransferEngine] = []

    def factory(host_id: str = "host-tier", overrides: dict[str, Any] | None = None,
                **kw: Any) -> TransferEngine:
        e = TransferEngine(load_transfer_config(overrides=overrides), host_id, **kw)
        engines.append(e)
        return e

    yield factory
    for e in engines:
        e.close()
