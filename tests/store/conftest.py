"""Fixtures: a real master and two node daemons on loopback (module-scoped, as
process startup dominates on this 2-core box), and pure clients per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.store import Client
from support.cuda_double import cuda_double  # noqa: F401 (a fixture of the GPU-path tests)
from support.factories import client_factory

LEASE_TTL_MS = 1000


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    d = tmp_path_factory.mktemp("master")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=LEASE_TTL_MS, client_ttl_s=3) as m:
        yield m


@pytest.fixture(scope="module")
def daemons(master: MasterProcess) -> Iterator[list[NodeDaemonProcess]]:
    ds = [NodeDaemonProcess(master.address, "32MiB") for _ in range(2)]
    try:
        for d in ds:
            d.start()
        yield ds
    finally:
        for d in ds:
            d.__exit__()


@pytest.fixture
def make_client(master: MasterProcess) -> Iterator[Callable[..., Client]]:
    with client_factory(master.address, rpc_timeout_s=5.0) as make:
        yield make


@pytest.fixture
def client(daemons: list[NodeDaemonProcess], make_client: Callable[..., Client]) -> Client:
    """A pure client (contributes nothing) with crc32 checksums, two daemons up."""
    return make_client(checksum="crc32")


@pytest.fixture
def key() -> Callable[[str], str]:
    """Unique keys per test (the master is shared by the module)."""
    tag = uuid.uuid4().hex[:8]
    return lambda name="k": f"{tag}/{name}"


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))
