"""Test factories: objects made by a fixture and closed at its teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.store.client import Client
from kvpool.store.config import ClientConfig

__all__ = ["client_factory", "closing_factory", "segment_desc"]

_T = TypeVar("_T")


@contextmanager
def closing_factory(make: Callable[..., _T],
                    close: Callable[[_T], Any] = lambda obj: obj.close()  # type: ignore[attr-defined]
                    ) -> Iterator[Callable[..., _T]]:
    """For "make_*" test fixtures: yields a factory that calls ``make(*args, **kw)``
    and remembers what it made; on exit every object made is closed (``close(obj)``,
    by default ``obj.close()``) in the order made. Usage in a fixture::

        with closing_factory(lambda size=1 << 20: Peer(size)) as make:
            yield make
    """
    made: list[_T] = []

    def factory(*args: Any, **kw: Any) -> _T:
        obj = make(*args, **kw)
        made.append(obj)
        return obj

    yield factory
    for obj in made:
        close(obj)


def segment_desc(segment_id: str, client_id: str, size: int = 1 << 20,
                 kind: SegmentKind = SegmentKind.MEMORY, host_id: str = "host-test",
                 endpoint: str = "tcp://127.0.0.1:1") -> SegmentDescriptor:
    """A SegmentDescriptor for MOUNT_SEGMENT in tests (no real region)."""
    return SegmentDescriptor(segment_id, client_id, host_id, kind, size, f"kvpool-{segment_id}",
                             endpoint=endpoint)


@contextmanager
def client_factory(master_address: str, **defaults: Any) -> Iterator[Callable[..., Client]]:
    """For "make_client" fixtures: yields ``make(**kw)``, which builds a Client of
    ``ClientConfig(**kw)`` (``master_address`` and ``defaults`` filled in where
    ``kw`` lacks them) and sets it up; every client made is closed on exit."""

    def make(**kw: Any) -> Client:
        kw.setdefault("master_address", master_address)
        for k, v in defaults.items():
            kw.setdefault(k, v)
        c = Client(ClientConfig(**kw))
        c.setup()
        return c

    with closing_factory(make) as factory:
        yield factory
