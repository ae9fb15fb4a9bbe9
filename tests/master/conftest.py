"""Fixtures for master tests: a real ``kvpool master`` subprocess per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.rpc_client import MasterClient


@pytest.fixture
def master_proc(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(data_dir=str(tmp_path / "data"), lease_ttl_ms=1000) as m:
        yield m


@pytest.fixture
def mclient(master_proc: MasterProcess) -> Iterator[MasterClient]:
    with master_proc.client(timeout_s=5) as c:
        yield c
