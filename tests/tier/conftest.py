"""Fixtures for the SSD-tier tests: engines and real peer processes owning
file segments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tier_helpers import FilePeer

from kvpool.transfer import TransferEngine, load_transfer_config
from support.factories import closing_factory


@pytest.fixture
def make_file_peer() -> Iterator[Any]:
    def create(directory: str, size: int = 8 << 20, host_id: str = "file-peer-host",
               **kw: Any) -> FilePeer:
        return FilePeer(directory, size, host_id, **kw)

    with closing_factory(create) as make:
        yield make


@pytest.fixture
def make_engine() -> Iterator[Any]:
    def create(host_id: str = "host-tier", overrides: dict[str, Any] | None = None,
               **kw: Any) -> TransferEngine:
        return TransferEngine(load_transfer_config(overrides=overrides), host_id, **kw)

    with closing_factory(create) as make:
        yield make
