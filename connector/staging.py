"""Staging buffers between vLLM's paged KV blocks and the store.

Blocks are gathered into (saves) or scattered from (loads) a contiguous
uint8 tensor on the cache's device, which the store moves in one transfer
batch. One save buffer (the save thread is the only user) and up to
``MAX_LOAD_BUFFERS`` load buffers: one in use plus ones still held by
transfers abandoned at their deadline (a frozen peer holds one until the
store's read timeout, capped by the read lease). What holds a load buffer is
a token Future (a load, or an abandoned transfer, uses it), a CUDA event
(scatters still reading it) or None (free).

On a GPU the buffers are registered with the store client when it connects,
and the copy path is warmed up once (kernels loaded, the same-host segment
mapped and page-locked) so the first request does not pay for it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from itertools import accumulate
from typing import Any, overload

from kvpool.connector.geometry import CacheGeometry
from kvpool.core.errors import KVPoolError
from kvpool.transfer.buffers import BufferHandle

__all__ = ["MAX_LOAD_BUFFERS", "StagingBuffers", "StagingViews", "release"]

log = logging.getLogger("kvpool.connector")

MAX_LOAD_BUFFERS = 3


def _free(held: Any) -> bool:
    """Whether a load buffer held by ``held`` is free."""
    if held is None:
        return True
    if isinstance(held, Future):
        return held.done()
    return bool(held.query())  # a CUDA event after the kernels reading the buffer


def release(token: Future[None] | None, _done: Any = None) -> None:
    """Resolve a load buffer's token (the buffer may be taken again)."""
    if token is not None and not token.done():
        token.set_result(None)


class StagingBuffers:
    """The save buffer and the pool of load buffers of one worker. Thread-safe."""

    def __init__(self, staging_mib: float, key_prefix: str) -> None:
        self.staging_mib = staging_mib
        self.key_prefix = key_prefix
        self.geo: CacheGeometry | None = None
        self._save: Any = None
        # load tensors and what holds each (see the module docstring); the first
        # is the one registered with the store on a GPU
        self._loads: list[tuple[Any, Any]] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    def attach(self, geo: CacheGeometry) -> None:
        self.geo = geo

    def _empty(self, nbytes: int) -> Any:
        import torch

        assert self.geo is not None
        return torch.empty(nbytes, dtype=torch.uint8, device=self.geo.device)

    def buffer_bytes(self) -> int:
        """Bytes of one staging buffer: ``staging_mib``, at least one chunk."""
        assert self.geo is not None
        return max(int(self.staging_mib * (1 << 20)), self.geo.chunk_bytes)

    def save_buffer(self, nbytes: int) -> Any:
        """The save tensor, grown to at least ``nbytes`` (save thread only)."""
        if self._save is None or self._save.numel() < nbytes:
            self._save = self._empty(nbytes)
        return self._save

    def take_load(self, nbytes: int) -> tuple[Any, Future[None]] | None:
        """A load tensor of >= ``nbytes`` plus the token that keeps it taken
        until resolved, or None when all ``MAX_LOAD_BUFFERS`` are taken. A
        transfer abandoned at its deadline keeps writing into its buffer until
        the store gives up on it, so its token is resolved only then."""
        token: Future[None] = Future()
        with self._lock:
            for i, (buf, held) in enumerate(self._loads):
                if _free(held):
                    if buf.numel() < nbytes:
                        buf = self._empty(nbytes)
                    self._loads[i] = (buf, token)
                    return buf, token
            if len(self._loads) >= MAX_LOAD_BUFFERS:
                return None
            buf = self._empty(nbytes)
            self._loads.append((buf, token))
            return buf, token

    def free_load(self, buf: Any, after: Any, _done: Any = None) -> None:
        """``buf`` is free once ``after`` (a CUDA event, or None) has passed."""
        with self._lock:
            for i, (b, _held) in enumerate(self._loads):
                if b is buf:
                    self._loads[i] = (b, after)

    def on_connect(self, client: Any) -> float | None:
        """On a GPU: allocate the buffers, register them with ``client``, warm
        the copy path. Returns the warm-up's seconds (None: not done)."""
        geo = self.geo
        if geo is None or not geo.cuda:
            return None
        save = self.save_buffer(self.buffer_bytes())
        with self._lock:
            if not self._loads or self._loads[0][0].numel() < self.buffer_bytes():
                self._loads[:1] = [(self._empty(self.buffer_bytes()), None)]
            load = self._loads[0][0]
        for buf in (save, load):
            try:
                self._handles.append(client.register_buffer(buf))
            except KVPoolError as exc:  # registration is an optimisation only
                log.warning("kvpool: could not register the staging buffer: %s", exc)
        t0 = time.perf_counter()
        key = f"{self.key_prefix}/warmup/{uuid.uuid4().hex}"
        try:
            # load the gather/scatter kernels now (CUDA loads modules lazily, ~70 ms
            # on first use); reads KV blocks only, scatters into scratch memory
            geo.objects.warm_up(save)
            client.put_from(key, save[:4096])
            client.get_into(key, load[:4096])
            client.remove(key, force=True)
        except Exception as exc:  # only an optimisation
            log.warning("kvpool: GPU copy path warm-up failed: %r", exc)
            return None
        secs = time.perf_counter() - t0
        log.info("kvpool: GPU copy path warmed up in %.3fs", secs)
        return secs

    def unregister(self, client: Any) -> None:
        for h in self._handles:
            try:
                if client is not None:
                    client.unregister_buffer(h)
            except Exception as exc:
                log.debug("kvpool: unregister: %s", exc)
        self._handles.clear()


class StagingViews(Sequence[BufferHandle]):
    """One GPU :class:`BufferHandle` per object, into consecutive ranges of one
    CUDA staging tensor, each made when the store asks for it (a pipelined
    read plans a part at a time: later parts' handles are made while earlier
    parts move). Handles take the store's direct GPU path (no tensor per
    object, DMAs of adjacent objects merged)."""

    def __init__(self, buf: Any, sizes: list[int]) -> None:
        self._buf = buf
        self._base = int(buf.data_ptr())
        self._dev = buf.device.index or 0
        self._sizes = sizes
        self._offsets = list(accumulate(sizes, initial=0))

    def __len__(self) -> int:
        return len(self._sizes)

    @overload
    def __getitem__(self, i: int) -> BufferHandle: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[BufferHandle]: ...

    def __getitem__(self, i: int | slice) -> BufferHandle | Sequence[BufferHandle]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return BufferHandle(ptr=self._base + self._offsets[i], length=self._sizes[i],
                            device="cuda", device_index=self._dev, owner=self._buf)
