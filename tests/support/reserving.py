"""Fixtures and helpers of the reservation tests (tests/store/test_reserved_put.py,
test_reserved_batch_put.py): a real master, one node daemon, clients made per
test, and a spy on the master requests a client sends. A test module takes the
fixtures by binding them to module names (``master = reserving.master``), which
overrides tests/store/conftest.py's."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.store import Client
from kvpool.store.spares import Spare
from support.factories import client_factory

__all__ = ["live", "make_client", "master", "pending", "spy_requests"]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    """A killed holder stays mounted (client TTL far past the tests): the
    master keeps placing on it, as in test_client_failures."""
    d = tmp_path_factory.mktemp("master")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=5000, client_ttl_s=120) as m:
        yield m


@pytest.fixture(scope="module")
def live(master: MasterProcess) -> Iterator[NodeDaemonProcess]:
    with NodeDaemonProcess(master.address, "32MiB") as d:
        yield d


@pytest.fixture
def make_client(master: MasterProcess, live: NodeDaemonProcess
                ) -> Iterator[Callable[..., Client]]:
    with client_factory(master.address, rpc_timeout_s=5.0) as make:
        yield make


def spy_requests(c: Client) -> list[str]:
    """The master requests ``c`` sends from now on, by type name (the real
    call still runs)."""
    sent: list[str] = []
    session = c._parts.session
    real = session.call

    def call(request: Any) -> Any:
        sent.append(type(request).__name__)
        return real(request)

    session.call = call  # type: ignore[method-assign]
    return sent


def spares(c: Client) -> OrderedDict[int, list[Spare]]:
    """The spare allocations ``c`` holds, by value size (groups, newest last)."""
    return c._parts.writes.spares.by_size


def held(c: Client) -> int:
    """How many spare allocations ``c`` holds in all."""
    return sum(len(s.placeholders) for group in spares(c).values() for s in group)


def pending(c: Client) -> int:
    """The puts in flight at the master (reservations included)."""
    return c.stats().pending
