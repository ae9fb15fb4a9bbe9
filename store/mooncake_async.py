"""``MooncakeDistributedStoreAsync``: Mooncake's asyncio wrapper (``mooncake.async_store``).

Every method ``m`` of :class:`~kvpool.store.mooncake.MooncakeDistributedStore`
is also available as the coroutine ``async_m`` with the same arguments,
running ``m`` in the event loop's default executor (the calls release the
event loop while they wait on the pool).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from kvpool.store.mooncake import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """:class:`MooncakeDistributedStore` plus ``async_<method>`` coroutines."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("async_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        sync = getattr(self, name[len("async_"):], None)
        if sync is None or not callable(sync):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' "
                                 f"(nor '{name[len('async_'):]}')")
        wrapper = _make_async(sync)
        setattr(self, name, wrapper)
        return wrapper


def _make_async(sync: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(sync)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(sync, *args, **kwargs))

    return wrapper
