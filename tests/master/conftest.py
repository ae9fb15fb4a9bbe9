"""Fixtures for master tests: a real ``kvpool master`` subprocess per test; for
the HA tests a real etcd and a group of three ``kvpool master --etcd``
instances (a test file may override ``group``, e.g. with two)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.rpc_client import MasterClient
from support.etcd import EtcdProcess
from support.ha_master import HaGroup


@pytest.fixture
def master_proc(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(data_dir=str(tmp_path / "data"), lease_ttl_ms=1000) as m:
        yield m


@pytest.fixture
def mclient(master_proc: MasterProcess) -> Iterator[MasterClient]:
    with master_proc.client(timeout_s=5) as c:
        yield c


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    with EtcdProcess() as e:
        yield e


@pytest.fixture
def group(etcd: EtcdProcess, tmp_path: Path) -> Iterator[HaGroup]:
    with HaGroup(etcd.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path)) as g:
        yield g
