"""Mooncake's tensor calls on whole tensors: put/get, into and from buffers, safetensors.

Objects have Mooncake's layout (:mod:`~kvpool.store.mooncake_tensor`):
``[TensorMetadata (304 bytes)][data]``. A put of several tensors is one
write of the compatibility layer (the metadata and the tensor's own memory
as two parts, no join: one master RPC, one transfer batch); reads locate
every key in one master RPC and return host tensors, as Mooncake's. The
calls that take a pointer (``*_from``, ``*_into``) move the bytes straight
between the caller's memory and the pool. The parallel layouts (TP shards,
``TensorParallelism``, writer partitions) are built on these calls in
:mod:`~kvpool.store.mooncake_tensor_parallel`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from kvpool.core.errors import KVPoolError
from kvpool.store._gpuptr import pointer_is_device
from kvpool.store.client import RangeRead
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_codes import INTERNAL, INVALID, NOT_FOUND, code_of, log, read_codes
from kvpool.store.mooncake_core import MooncakeCore, pick_groups
from kvpool.store.mooncake_memory import CallerMemory
from kvpool.store.mooncake_objects import ObjectIO
from kvpool.store.mooncake_tensor import (
    METADATA_SIZE,
    TensorMeta,
    TensorWrite,
    dtype_code,
    is_tensor,
    parse_metadata,
    payload,
    tensor_at,
    tensor_from,
    tensor_meta,
)
from kvpool.store.mooncake_zerocopy import ZeroCopyCalls

__all__ = ["TensorCalls"]


class TensorCalls:
    """The whole-tensor calls of one store (module docstring)."""

    def __init__(self, core: MooncakeCore, memory: CallerMemory, io: ObjectIO,
                 zero_copy: ZeroCopyCalls) -> None:
        self._core = core
        self._memory = memory
        self._io = io
        self._zero_copy = zero_copy

    # ------------------------------------------------------------------ the one write

    def write(self, objects: Sequence[Sequence[TensorWrite] | None],
              config: ReplicateConfig | None, upsert: bool) -> list[int]:
        """Store every caller key's objects in one batch (None: the key is
        refused with INVALID_PARAMS). ``config.group_ids`` has one entry per
        caller key; each of a key's objects joins its group. Per caller key 0
        or the first error among its objects."""
        out = [INVALID if objs is None else 0 for objs in objects]
        owner: list[int] = []
        keys: list[str] = []
        parts: list[list[Any]] = []
        for i, objs in enumerate(objects):
            for w in objs or ():
                owner.append(i)
                keys.append(w.key)
                parts.append(w.parts)
        try:
            cfg = pick_groups(self._core.config(config, len(objects)), owner)
        except KVPoolError as exc:
            return [code_of(exc)] * len(objects)
        for i, c in zip(owner, self._io.write(keys, parts, cfg, staged=True, upsert=upsert),
                        strict=True):
            if c != 0 and out[i] == 0:
                out[i] = c
        return out

    # ------------------------------------------------------------------ whole tensors

    def put(self, keys: Sequence[str], tensors: Sequence[Any], config: ReplicateConfig | None,
            upsert: bool) -> list[int]:
        """Store each tensor (CPU or CUDA) at its key: per key 0 or a Mooncake
        code (-600: not a tensor, unsupported dtype; every key -600 on lists
        of different lengths or none)."""
        if len(keys) != len(tensors) or not keys:
            return [INVALID] * len(keys)
        objects: list[list[TensorWrite] | None] = []
        for key, t in zip(keys, tensors, strict=True):
            try:
                objects.append([TensorWrite.of(key, t, tensor_meta(t))])
            except KVPoolError as exc:
                log.error("tensor for %r: %s", key, exc)
                objects.append(None)
        return self.write(objects, config, upsert)

    def objects(self, keys: Sequence[str]) -> list[tuple[TensorMeta, Any] | None]:
        """Each key's tensor object (its metadata and the buffer holding it),
        None where missing or not a tensor object. One master RPC, one
        transfer batch."""
        out: list[tuple[TensorMeta, Any] | None] = []
        for h in self._io.read(keys):
            meta = parse_metadata(h, len(h)) if h is not None else None
            out.append(None if meta is None else (meta, h))
        return out

    def get(self, keys: Sequence[str]) -> list[Any]:
        """The tensors stored at ``keys`` (host memory), None where missing or
        not a tensor object."""
        return [None if o is None else tensor_from(o[0], o[1]) for o in self.objects(keys)]

    def get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[Any]:
        """Read each tensor object into ``[buffer_ptrs[i], +sizes[i])`` (host
        memory) and return a tensor viewing it there, or None; a list of -600
        when the lists differ in length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        got = self._zero_copy.batch_get_into(keys, buffer_ptrs, sizes)
        return [tensor_at(int(p), r) if r > 0 else None
                for r, p in zip(got, buffer_ptrs, strict=True)]

    def put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                 upsert: bool) -> list[int]:
        """Store serialized tensors (``[TensorMetadata][data]``) from caller
        memory, the layout checked first (-600 when invalid). Per key 0 or a
        Mooncake code."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)) or not keys:
            return [INVALID] * len(keys)
        parts: list[list[Any] | None] = []
        try:
            for p, n in zip(buffer_ptrs, sizes, strict=True):
                valid = self.buffer_meta(int(p), int(n)) is not None
                parts.append([self._memory.slice(int(p), int(n))] if valid else None)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return self._io.write(keys, parts, None, staged=False, upsert=upsert)

    def get_into_tensors(self, keys: Sequence[str], tensors: Sequence[Any]) -> list[int]:
        """Read each stored tensor's data straight into ``tensors[i]`` (CUDA or
        CPU; dtype and size must match): one master RPC, the 304-byte headers,
        then every payload in one transfer batch. Per key the bytes read or a
        Mooncake code (-600: mismatch or not a tensor object)."""
        out = [INVALID] * len(keys)
        if len(keys) != len(tensors) or not keys:
            return out
        try:
            client = self._core.live()
            locs = client.batch_locate(self._core.keys(keys))
            heads = [bytearray(METADATA_SIZE) for _ in keys]
            got = read_codes(client.read_ranges([RangeRead(loc, h, 0, METADATA_SIZE)
                                                 for loc, h in zip(locs, heads, strict=True)]))
            reads: list[RangeRead] = []
            owner: list[int] = []
            for i, (loc, h, n, dst) in enumerate(zip(locs, heads, got, tensors, strict=True)):
                if n != METADATA_SIZE:
                    out[i] = n if n < 0 else INVALID
                    continue
                meta = parse_metadata(h, loc.size)
                if meta is None or not is_tensor(dst) or not dst.is_contiguous() \
                        or dtype_code(dst.dtype) != meta.dtype \
                        or int(dst.numel()) * int(dst.element_size()) != meta.data_bytes:
                    continue
                if meta.data_bytes == 0:
                    out[i] = 0
                    continue
                reads.append(RangeRead(loc, payload(dst), meta.data_offset, meta.data_bytes))
                owner.append(i)
            for i, r in zip(owner, read_codes(client.read_ranges(reads)), strict=True):
                out[i] = r
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return out

    # ------------------------------------------------------------------ serialized in caller memory

    def buffer_meta(self, ptr: int, size: int) -> TensorMeta | None:
        """The metadata of a serialized tensor in caller memory (host, or GPU:
        the 304-byte header is copied to the host first), None if invalid."""
        if size < METADATA_SIZE:
            return None
        if pointer_is_device(ptr):
            from kvpool.transfer.gpu import cuda_runtime

            rt, _ = cuda_runtime()
            if rt is None:
                return None
            head = (ctypes.c_uint8 * METADATA_SIZE)()
            rt.memcpy(ctypes.addressof(head), ptr, METADATA_SIZE)  # cudaMemcpyDefault
            return parse_metadata(memoryview(head), size)
        raw = (ctypes.c_uint8 * METADATA_SIZE).from_address(ptr)
        return parse_metadata(memoryview(raw), size)

    def views_at(self, buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        """Tensors over serialized tensors in caller host memory (None where
        one is not valid)."""
        out: list[Any] = []
        for p, n in zip(buffer_ptrs, sizes, strict=True):
            ptr, size = int(p), int(n)
            meta = self.buffer_meta(ptr, size)
            out.append(None if meta is None
                       else tensor_from(meta, (ctypes.c_uint8 * size).from_address(ptr)))
        return out

    # ------------------------------------------------------------------ safetensors

    def save_safetensor(self, key: str, file_name: str | None) -> int:
        """Write the tensor at ``key`` to a safetensors file (``file_name``,
        default the key) under the name ``key``: 0 or a Mooncake code."""
        (tensor,) = self.get([key])
        if tensor is None:
            return NOT_FOUND
        try:
            from safetensors.torch import save_file
        except ImportError:
            log.error("save_tensor_to_safetensor needs the safetensors package")
            return INTERNAL
        try:
            save_file({key: tensor.contiguous()}, file_name or key)
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("save_tensor_to_safetensor %r: %s", key, exc)
            return INTERNAL
        return 0

    def load_safetensor(self, key: str | None, file_name: str) -> Any:
        """Load a tensor from a safetensors file and store it at ``key``
        (default: the file name): the file's entry named ``key``, else its
        first entry (logged). The tensor, or None."""
        if not file_name:
            return None
        target = key or file_name
        try:
            from safetensors.torch import load_file
        except ImportError:
            log.error("load_tensor_from_safetensor needs the safetensors package")
            return None
        try:
            loaded = load_file(file_name)
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("load_tensor_from_safetensor %r: %s", file_name, exc)
            return None
        if not loaded:
            return None
        name = target if target in loaded else next(iter(loaded))
        if name != target:
            log.warning("key %r not found in %s; using its first entry %r", target, file_name,
                        name)
        tensor = loaded[name]
        return tensor if self.put([target], [tensor], None, upsert=False) == [0] else None
