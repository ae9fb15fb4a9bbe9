"""Mooncake's tensor API on kvpool, with Mooncake's serialized object layout.

A tensor object is ``[TensorMetadata (304 bytes)][tensor bytes]``, byte for
byte what Mooncake 0.3.12/0.3.13 writes (``integration_utils.h``), so a
tensor put through either library's API is read by the other's:

    TensorObjectHeader (40): magic "NOOM" (0x4d4f4f4e), version 1,
        header_size 304, dtype, ndim, layout_kind (0 full, 1 shard),
        reserved_flags, data_offset (304), data_bytes
    TensorLayoutMetadata (264): global_shape[8], local_shape[8] (int64,
        unused dims -1), axis_count, reserved, 4 x LayoutAxis (kind, axis
        index, shard rank, shard count, split_dim, reserved0 = expert/stage
        id, reserved1 = local extent of split_dim)

Keys follow Mooncake: TP shards ``key_tp_<rank>``; parallelism shards
``key__dp_1of2__tp_0of2_sd0`` (axes in DP, TP, EP, PP order); writer
partitions ``key__writer_<r>of<n>_sd<d>`` with a 96-byte manifest at
``key__writer_manifest`` (``key__parallelism_manifest`` for TP layouts):
magic "NAMW", version 1, size 96, dtype, ndim, split_dim, shard_count, the
global shape.

Puts of several objects (TP shards, batches) are one ``batch_put_parts``
(the metadata and the tensor's own memory as two parts, no join); reads
locate every key in one master RPC. Tensors may be CPU or CUDA (the
transfer engine moves GPU memory; metadata stays on the host).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store.client import RangeRead
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_core import INVALID, MooncakeCore, code_of, mooncake_code
from kvpool.store.mooncake_types import BufferHandle

__all__ = [
    "METADATA_SIZE",
    "TensorCalls",
    "TensorMeta",
    "_deserialize_tensor",
    "_serialize_tensor",
    "_tensor_metadata_size",
    "pack_metadata",
    "parse_metadata",
]

log = logging.getLogger("kvpool.store.mooncake")

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
LAYOUT_FULL, LAYOUT_SHARD = 0, 1
_HEADER = struct.Struct("<IHHiiIIQQ")  # 40 bytes
_SHAPE = struct.Struct("<8q")  # 64
_AXIS = struct.Struct("<6iq")  # 32
_COUNTS = struct.Struct("<II")
METADATA_SIZE = _HEADER.size + 2 * _SHAPE.size + _COUNTS.size + MAX_AXES * _AXIS.size  # 304
MANIFEST_MAGIC = 0x574D414E
_MANIFEST_HEAD = struct.Struct("<IHHiiiii4x")  # 32 (28 + padding before the int64 shape)
MANIFEST_SIZE = _MANIFEST_HEAD.size + _SHAPE.size  # 96

AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
_AXIS_ORDER = ("dp", "tp", "ep", "pp")
# Mooncake's TensorDtype codes, by torch dtype name
DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
          "int64", "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _torch() -> Any:
    import torch

    return torch


@dataclass
class AxisMeta:
    """One LayoutAxis of a shard's metadata."""

    kind: int
    index: int
    rank: int
    count: int
    split_dim: int = -1
    reserved0: int = 0  # expert id (EP) / stage id (PP)
    reserved1: int = 0  # the shard's extent along split_dim


@dataclass
class TensorMeta:
    """The 304-byte metadata of a tensor object (module docstring)."""

    dtype: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    layout: int = LAYOUT_FULL
    axes: list[AxisMeta] = field(default_factory=list)
    data_offset: int = METADATA_SIZE
    data_bytes: int = 0

    def element_size(self) -> int:
        return _torch().empty(0, dtype=dtype_of(self.dtype)).element_size()


def _shape8(shape: Sequence[int]) -> bytes:
    dims = [int(d) for d in shape] + [-1] * (MAX_DIMS - len(shape))
    return _SHAPE.pack(*dims)


def pack_metadata(meta: TensorMeta) -> bytes:
    """The 304 bytes Mooncake writes for ``meta``."""
    head = _HEADER.pack(MAGIC, VERSION, METADATA_SIZE, meta.dtype, len(meta.local_shape),
                        meta.layout, 0, meta.data_offset, meta.data_bytes)
    axes = b"".join(_AXIS.pack(a.kind, a.index, a.rank, a.count, a.split_dim, a.reserved0,
                               a.reserved1) for a in meta.axes[:MAX_AXES])
    axes += bytes(_AXIS.size * (MAX_AXES - min(len(meta.axes), MAX_AXES)))
    return (head + _shape8(meta.global_shape) + _shape8(meta.local_shape)
            + _COUNTS.pack(min(len(meta.axes), MAX_AXES), 0) + axes)


def parse_metadata(data: bytes | bytearray | memoryview, total_length: int) -> TensorMeta | None:
    """The metadata at the start of a ``total_length``-byte object, or None if
    it is not a valid tensor object (Mooncake's ValidateTensorMetadata)."""
    if len(data) < METADATA_SIZE or total_length < METADATA_SIZE:
        return None
    mv = memoryview(data)[:METADATA_SIZE]
    (magic, version, hsize, dtype, ndim, layout, _flags, off,
     nbytes) = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION or hsize != METADATA_SIZE:
        return None
    if not 0 <= dtype < len(DTYPES) or not 0 <= ndim <= MAX_DIMS or layout > LAYOUT_SHARD:
        return None
    gshape = _SHAPE.unpack_from(mv, _HEADER.size)
    lshape = _SHAPE.unpack_from(mv, _HEADER.size + _SHAPE.size)
    count, _ = _COUNTS.unpack_from(mv, _HEADER.size + 2 * _SHAPE.size)
    if count > MAX_AXES or off < METADATA_SIZE or off > total_length \
            or nbytes != total_length - off:
        return None
    if any(d < 0 for d in gshape[:ndim] + lshape[:ndim]) \
            or any(d != -1 for d in gshape[ndim:] + lshape[ndim:]):
        return None
    base = _HEADER.size + 2 * _SHAPE.size + _COUNTS.size
    axes = [AxisMeta(*_AXIS.unpack_from(mv, base + i * _AXIS.size)) for i in range(count)]
    for a in axes:
        if not 0 <= a.kind <= 4 or a.count <= 0 or not 0 <= a.rank < a.count \
                or not -1 <= a.split_dim < ndim:
            return None
    meta = TensorMeta(dtype, tuple(gshape[:ndim]), tuple(lshape[:ndim]), layout, axes, off,
                      nbytes)
    numel = 1
    for d in meta.local_shape:
        numel *= d
    if nbytes != numel * _ELEMENT_SIZES[dtype]:
        return None
    return meta


_ELEMENT_SIZES = (4, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 1, 1)


def dtype_code(dtype: Any) -> int:
    """Mooncake's TensorDtype code of a torch dtype (-1: unsupported)."""
    name = str(dtype).rsplit(".", 1)[-1]
    return DTYPES.index(name) if name in DTYPES else -1


def dtype_of(code: int) -> Any:
    return getattr(_torch(), DTYPES[code])


def _is_tensor(obj: Any) -> bool:
    # Mooncake's test: the object's class name contains "Tensor"
    return "Tensor" in type(obj).__name__ and hasattr(obj, "data_ptr")


def _payload(tensor: Any) -> Any:
    """The tensor's bytes as a flat uint8 tensor (no copy when contiguous)."""
    t = tensor.contiguous()
    return t.reshape(-1).view(_torch().uint8)


def tensor_meta(tensor: Any, axes: Sequence[AxisMeta] = (),
                global_shape: Sequence[int] | None = None) -> TensorMeta:
    """The metadata of a full tensor (no axes) or of a shard. Raises KVPoolError."""
    if not _is_tensor(tensor):
        raise KVPoolError("not a PyTorch tensor", ErrorCode.INVALID_PARAMS)
    code = dtype_code(tensor.dtype)
    if code < 0:
        raise KVPoolError(f"unsupported tensor dtype {tensor.dtype}", ErrorCode.INVALID_PARAMS)
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) > MAX_DIMS:
        raise KVPoolError(f"tensor has more than {MAX_DIMS} dimensions",
                          ErrorCode.INVALID_PARAMS)
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    layout = LAYOUT_SHARD if axes else LAYOUT_FULL
    return TensorMeta(code, tuple(global_shape) if global_shape is not None else shape, shape,
                      layout, list(axes), METADATA_SIZE, nbytes)


def tensor_from(meta: TensorMeta, data: Any) -> Any:
    """A tensor viewing ``data`` (a writable buffer holding the whole object)."""
    torch = _torch()
    dtype = dtype_of(meta.dtype)
    if meta.data_bytes == 0:
        return torch.empty(meta.local_shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, count=meta.data_bytes,
                            offset=meta.data_offset)
    return flat.view(dtype).reshape(meta.local_shape)


def _serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """Mooncake's module function: ``(metadata bytes, data pointer, data size,
    owner)`` of a tensor (the owner keeps the contiguous data alive).
    ValueError for a tensor Mooncake cannot serialize."""
    try:
        meta = tensor_meta(tensor)
    except KVPoolError as exc:
        raise ValueError("unsupported tensor for Mooncake tensor serialization") from exc
    owner = tensor.contiguous()
    return pack_metadata(meta), int(owner.data_ptr()), meta.data_bytes, owner


def _tensor_metadata_size() -> int:
    """Bytes of the serialized tensor metadata (304)."""
    return METADATA_SIZE


def _deserialize_tensor(payload: bytes) -> Any:
    """A tensor from ``[metadata][data]`` bytes; ValueError when invalid."""
    buf = bytearray(payload)
    meta = parse_metadata(buf, len(buf))
    if meta is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return tensor_from(meta, buf)


# ---------------------------------------------------------------------- parallel layouts


@dataclass(frozen=True)
class _Axis:
    kind: str
    rank: int
    size: int
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None

    def suffix(self) -> str:
        s = f"{self.kind}_{self.rank}of{self.size}"
        if self.split_dim is not None:
            s += f"_sd{self.split_dim}"
        if self.expert_id is not None:
            s += f"_eid{self.expert_id}"
        if self.stage_id is not None:
            s += f"_sid{self.stage_id}"
        return s

    def meta(self, index: int, local_extent: int) -> AxisMeta:
        extra = self.expert_id if self.kind == "ep" else self.stage_id if self.kind == "pp" else 0
        return AxisMeta(AXIS_KINDS[self.kind], index, self.rank, self.size,
                        -1 if self.split_dim is None else self.split_dim, extra or 0,
                        local_extent)


def _parse_axes(parallelism: Any) -> list[_Axis]:
    """Validated axes of a TensorParallelism (Mooncake's rules). Raises KVPoolError."""
    axes_in = getattr(parallelism, "axes", None)
    if not axes_in or len(axes_in) > MAX_AXES:
        raise KVPoolError("parallelism needs 1..4 axes", ErrorCode.INVALID_PARAMS)
    out: list[_Axis] = []
    for a in axes_in:
        kind = str(getattr(a, "kind", "")).lower()
        if kind not in AXIS_KINDS:
            raise KVPoolError(f"unsupported axis kind {kind!r}", ErrorCode.INVALID_PARAMS)
        ax = _Axis(kind, int(a.rank), int(a.size), getattr(a, "split_dim", None),
                   getattr(a, "expert_id", None), getattr(a, "stage_id", None))
        if ax.size <= 0 or not 0 <= ax.rank < ax.size or any(o.kind == kind for o in out):
            raise KVPoolError(f"invalid {kind} axis", ErrorCode.INVALID_PARAMS)
        bad = {"tp": ax.split_dim is None,
               "dp": ax.split_dim is not None,
               "ep": ax.expert_id is None or ax.split_dim is not None,
               "pp": ax.stage_id is None or ax.split_dim is not None}[kind]
        if bad:
            raise KVPoolError(f"invalid {kind} axis fields", ErrorCode.INVALID_PARAMS)
        out.append(ax)
    return out


def _tp(axes: Sequence[_Axis]) -> _Axis | None:
    return next((a for a in axes if a.kind == "tp"), None)


def parallel_key(base: str, axes: Sequence[_Axis]) -> str:
    """Mooncake's storage key of a shard (single TP axis: ``base_tp_<rank>``)."""
    if len(axes) == 1 and axes[0].kind == "tp":
        return f"{base}_tp_{axes[0].rank}"
    ordered = sorted(axes, key=lambda a: _AXIS_ORDER.index(a.kind))
    return base + "".join(f"__{a.suffix()}" for a in ordered)


def _matches(meta: TensorMeta, axes: Sequence[_Axis]) -> bool:
    """Whether a stored shard's metadata is the shard ``axes`` name (a key can
    hold a shard of another layout, e.g. ``k_tp_0`` of 2 ranks read as 1 of 3)."""
    if meta.layout != LAYOUT_SHARD or len(meta.axes) != len(axes):
        return False
    stored = {(a.kind, a.rank, a.count, a.split_dim) for a in meta.axes}
    return all((AXIS_KINDS[a.kind], a.rank, a.size,
                -1 if a.split_dim is None else a.split_dim) in stored for a in axes)


def _with_tp_rank(axes: Sequence[_Axis], rank: int) -> list[_Axis]:
    return [dataclasses.replace(a, rank=rank) if a.kind == "tp" else a for a in axes]


def pack_manifest(dtype: int, global_shape: Sequence[int], split_dim: int, count: int) -> bytes:
    """The 96-byte writer/parallelism manifest."""
    return _MANIFEST_HEAD.pack(MANIFEST_MAGIC, 1, MANIFEST_SIZE, dtype, len(global_shape),
                               split_dim, count, 0) + _shape8(global_shape)


def parse_manifest(data: bytes | bytearray | None) -> tuple[int, tuple[int, ...], int, int] | None:
    """``(dtype, global_shape, split_dim, shard_count)`` or None if invalid."""
    if data is None or len(data) < MANIFEST_SIZE:
        return None
    magic, ver, size, dtype, ndim, sd, count, _ = _MANIFEST_HEAD.unpack_from(data, 0)
    if magic != MANIFEST_MAGIC or ver != 1 or size != MANIFEST_SIZE or not 0 <= ndim <= MAX_DIMS \
            or count <= 0 or not 0 <= sd < ndim:
        return None
    shape = _SHAPE.unpack_from(data, _MANIFEST_HEAD.size)[:ndim]
    if any(d < 0 for d in shape):
        return None
    return dtype, tuple(shape), sd, count


def _shard(tensor: Any, split_dim: int, rank: int, count: int) -> Any:
    """The ``rank``-th of ``count`` equal slices along ``split_dim`` (uniform
    sharding only, as Mooncake). Raises KVPoolError."""
    if not 0 <= split_dim < tensor.dim() or count <= 0 or not 0 <= rank < count \
            or tensor.shape[split_dim] % count:
        raise KVPoolError("only uniform sharding is supported", ErrorCode.INVALID_PARAMS)
    n = tensor.shape[split_dim] // count
    return tensor.narrow(split_dim, rank * n, n).contiguous()


def _shard_meta(full_shape: Sequence[int], shard: Any, axes: Sequence[_Axis]) -> TensorMeta:
    local = [int(d) for d in shard.shape]
    metas = [a.meta(i, local[a.split_dim] if a.split_dim is not None else 0)
             for i, a in enumerate(axes)]
    return tensor_meta(shard, metas, full_shape)


@dataclass
class _Write:
    """One object of a tensor write: its key and parts (metadata, data)."""

    key: str
    parts: list[Any]


class TensorCalls(MooncakeCore):
    """The tensor calls of ``MooncakeDistributedStore`` (module docstring)."""

    # ------------------------------------------------------------------ plumbing

    def _tensor_write(self, tensor: Any, key: str, axes: Sequence[_Axis] = (),
                      full_shape: Sequence[int] | None = None) -> _Write:
        meta = _shard_meta(full_shape or tensor.shape, tensor, axes) if axes \
            else tensor_meta(tensor)
        parts: list[Any] = [pack_metadata(meta)]
        if meta.data_bytes:
            parts.append(_payload(tensor))
        return _Write(key, parts)

    def _write_objects(self, writes: Sequence[_Write | None], config: ReplicateConfig | None,
                       upsert: bool = False) -> list[int]:
        """Store every write in one batch (None entries: INVALID_PARAMS)."""
        idx = [i for i, w in enumerate(writes) if w is not None]
        out = [INVALID] * len(writes)
        if not idx:
            return out
        ws = [writes[i] for i in idx]
        assert all(w is not None for w in ws)
        keys = [w.key for w in ws if w is not None]
        parts = [w.parts for w in ws if w is not None]
        if upsert:
            codes = self._upsert_many(keys, parts, config, staged=True)
        else:
            codes = self._put_objects(keys, parts, config)
        for i, c in zip(idx, codes, strict=True):
            out[i] = c
        return out

    def _put_objects(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                     config: ReplicateConfig | None) -> list[int]:
        try:
            from kvpool.store._bufutil import buffer_nbytes

            if not self._fits_staging(sum(buffer_nbytes(p) for ps in parts for p in ps)):
                return [INVALID] * len(keys)
            codes = self._c().batch_put_parts(self._ks(keys), parts,
                                              self._config(config, len(keys)))
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return [0 if c in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) else mooncake_code(c)
                for c in codes]

    def _read_objects(self, keys: Sequence[str]) -> list[tuple[TensorMeta, Any] | None]:
        """Each key's tensor object (metadata and its whole buffer) or None;
        one master RPC, one transfer batch."""
        handles = self._read_buffers(keys)
        out: list[tuple[TensorMeta, Any] | None] = []
        for h in handles:
            meta = parse_metadata(h, len(h)) if h is not None else None
            out.append(None if meta is None else (meta, h))
        return out

    def _read_buffers(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        out: list[BufferHandle | None] = [None] * len(keys)
        if self._client is None or not keys:
            return out
        valid = [(i, k) for i, k in ((i, self._k_or_none(k)) for i, k in enumerate(keys))
                 if k is not None]
        try:
            locs = self._client.batch_locate([k for _, k in valid])
            found = [(i, loc) for (i, _k), loc in zip(valid, locs, strict=True)
                     if loc.code == ErrorCode.OK]
            if not self._fits_staging(sum(loc.size for _, loc in found)):
                return out
            bufs = {i: BufferHandle(loc.size) for i, loc in found}
            got = self._client.read_ranges([RangeRead(loc, bufs[i], 0, loc.size)
                                            for i, loc in found])
        except KVPoolError as exc:
            log.debug("tensor read: %s", exc)
            return out
        for (i, loc), n in zip(found, got, strict=True):
            if n == loc.size:
                out[i] = bufs[i]
        return out

    def _tensors(self, keys: Sequence[str]) -> list[Any]:
        return [None if o is None else tensor_from(o[0], o[1]) for o in self._read_objects(keys)]

    # ------------------------------------------------------------------ full tensors

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor (CPU or CUDA) as a Mooncake tensor object. 0 or
        a negative code (-600: not a tensor, unsupported dtype)."""
        return self.pub_tensor(key, tensor)

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """:meth:`put_tensor` with a ReplicateConfig."""
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        """:meth:`put_tensor` for many keys (one master RPC, one transfer batch)."""
        return self.batch_pub_tensor(keys, tensors_list)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        """:meth:`pub_tensor` for many keys; -600 for every key on mismatched lengths."""
        return self._batch_tensor_write(keys, tensors_list, config, upsert=False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Insert or replace a tensor object."""
        return self.batch_upsert_pub_tensor([key], [tensor])[0]

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        """:meth:`upsert_tensor` with a ReplicateConfig."""
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self.batch_upsert_pub_tensor(keys, tensors_list)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._batch_tensor_write(keys, tensors_list, config, upsert=True)

    def _batch_tensor_write(self, keys: Sequence[str], tensors: Sequence[Any],
                            config: ReplicateConfig | None, upsert: bool) -> list[int]:
        if len(keys) != len(tensors) or not keys:
            return [INVALID] * len(keys)
        writes: list[_Write | None] = []
        for key, t in zip(keys, tensors, strict=True):
            try:
                writes.append(self._tensor_write(t, key))
            except KVPoolError as exc:
                log.error("tensor for %r: %s", key, exc)
                writes.append(None)
        return self._write_objects(writes, config, upsert)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (CPU), or None."""
        return self._tensors([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        """Tensors in key order, None where missing (one master RPC)."""
        return self._tensors(keys)

    # ------------------------------------------------------------------ into / from buffers

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read the tensor object into ``[buffer_ptr, +size)`` (host memory) and
        return a tensor viewing its data there, or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[Any]:
        """:meth:`get_tensor_into` for many keys; a list of -600 on mismatched lengths."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)  # type: ignore[attr-defined]
        out: list[Any] = []
        for r, p in zip(got, buffer_ptrs, strict=True):
            out.append(self._tensor_at(int(p), r) if r > 0 else None)
        return out

    @staticmethod
    def _tensor_at(ptr: int, length: int) -> Any:
        import ctypes

        raw = (ctypes.c_uint8 * length).from_address(ptr)
        meta = parse_metadata(memoryview(raw), length)
        return None if meta is None else tensor_from(meta, raw)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` laid out as
        ``[TensorMetadata][data]`` (checked first; -600 when invalid)."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        return self._tensor_from_write(keys, buffer_ptrs, sizes, upsert=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        return self._tensor_from_write(keys, buffer_ptrs, sizes, upsert=True)

    def _tensor_from_write(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                           upsert: bool) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)) or not keys:
            return [INVALID] * len(keys)
        writes: list[_Write | None] = []
        for key, p, n in zip(keys, ptrs, sizes, strict=True):
            if self._buffer_meta(int(p), int(n)) is None:
                writes.append(None)
            else:
                writes.append(_Write(key, [self._slice(int(p), int(n))]))
        if upsert:
            return self._write_objects(writes, None, upsert=True)
        idx = [i for i, w in enumerate(writes) if w is not None]
        out = [INVALID] * len(keys)
        codes = self._put_from_objects([writes[i] for i in idx])  # type: ignore[misc]
        for i, c in zip(idx, codes, strict=True):
            out[i] = c
        return out

    def _put_from_objects(self, writes: Sequence[_Write]) -> list[int]:
        try:
            codes = self._c().batch_put_parts(self._ks([w.key for w in writes]),
                                              [w.parts for w in writes], None)
        except KVPoolError as exc:
            return [code_of(exc)] * len(writes)
        return [0 if c in (ErrorCode.OK, ErrorCode.OBJECT_ALREADY_EXISTS) else mooncake_code(c)
                for c in codes]

    def _buffer_meta(self, ptr: int, size: int) -> TensorMeta | None:
        """The metadata of a serialized tensor in caller memory (host, or GPU:
        the 304-byte header is copied to the host first)."""
        if size < METADATA_SIZE:
            return None
        import ctypes

        from kvpool.store._gpuptr import pointer_is_device

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

    def _tensor_view_at(self, ptr: int, size: int) -> Any:
        """A tensor over a serialized tensor in caller host memory, or None."""
        meta = self._buffer_meta(ptr, size)
        if meta is None:
            return None
        import ctypes

        return tensor_from(meta, (ctypes.c_uint8 * size).from_address(ptr))

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Read the tensor object's data straight into ``tensor`` (CUDA or CPU;
        its dtype and size must match the stored tensor). Bytes read or a
        negative code (-600: mismatch or not found as a tensor)."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: Sequence[str],
                                   tensors_list: Sequence[Any]) -> list[int]:
        """:meth:`get_tensor_into_cuda` for many keys: one master RPC, then the
        304-byte headers, then every payload in one transfer batch."""
        out = [INVALID] * len(keys)
        if len(keys) != len(tensors_list) or not keys:
            return out
        try:
            client = self._c()
            pool = self._ks(keys)
            locs = client.batch_locate(pool)
            heads = [bytearray(METADATA_SIZE) for _ in keys]
            got = client.read_ranges([RangeRead(loc, h, 0, METADATA_SIZE)
                                      for loc, h in zip(locs, heads, strict=True)])
            reads: list[RangeRead] = []
            owner: list[int] = []
            for i, (loc, h, n, dst) in enumerate(zip(locs, heads, got, tensors_list,
                                                     strict=True)):
                if n != METADATA_SIZE:
                    out[i] = mooncake_code(n) if n < 0 else INVALID
                    continue
                meta = parse_metadata(h, loc.size)
                if meta is None or not _is_tensor(dst) or not dst.is_contiguous() \
                        or dtype_code(dst.dtype) != meta.dtype \
                        or int(dst.numel()) * int(dst.element_size()) != meta.data_bytes:
                    continue
                if meta.data_bytes == 0:
                    out[i] = 0
                    continue
                reads.append(RangeRead(loc, _payload(dst), meta.data_offset, meta.data_bytes))
                owner.append(i)
            for i, r in zip(owner, client.read_ranges(reads), strict=True):
                out[i] = r if r >= 0 else mooncake_code(r)
        except KVPoolError as exc:
            return [code_of(exc)] * len(keys)
        return out

    # ------------------------------------------------------------------ tensor parallelism (TP)

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Split ``tensor`` into ``tp_size`` equal shards along ``split_dim`` and
        store every shard as ``key_tp_<rank>`` (one batch; ``tp_rank`` is
        accepted for the signature). ``tp_size`` 1: :meth:`put_tensor`."""
        return self.pub_tensor_with_tp(key, tensor, None, tp_rank, tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        res = self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size, split_dim)
        return res[0]

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size,
                                             split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        """Every tensor's TP shards in one batch; per base key 0 or the first
        shard's error (-600 for non-uniform sharding)."""
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        if len(base_keys) != len(tensors_list) or not base_keys:
            return [INVALID] * len(base_keys)
        writes: list[_Write | None] = []
        owner: list[int] = []
        out = [INVALID] * len(base_keys)
        for i, (key, t) in enumerate(zip(base_keys, tensors_list, strict=True)):
            try:
                shards = [self._tensor_write(
                    _shard(t, split_dim, r, tp_size), f"{key}_tp_{r}",
                    [_Axis("tp", r, tp_size, split_dim)], t.shape) for r in range(tp_size)]
            except (KVPoolError, AttributeError, RuntimeError) as exc:
                log.error("put_tensor_with_tp %r: %s", key, exc)
                continue
            writes.extend(shards)
            owner.extend([i] * tp_size)
            out[i] = 0
        if config is not None and config.group_ids is not None:
            config = dataclasses.replace(config, group_ids=[config.group_ids[i] for i in owner])
        for i, c in zip(owner, self._write_objects(writes, config), strict=True):
            if c != 0 and out[i] == 0:
                out[i] = c
        return out

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """The shard ``key_tp_<tp_rank>`` (``tp_size`` > 1) or the tensor at ``key``."""
        return self.get_tensor(f"{key}_tp_{tp_rank}" if tp_size > 1 else key)

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        keys = [f"{k}_tp_{tp_rank}" for k in base_keys] if tp_size > 1 else list(base_keys)
        return self.batch_get_tensor(keys)

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        return self.get_tensor_into(f"{key}_tp_{tp_rank}" if tp_size > 1 else key,
                                    buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        keys = [f"{k}_tp_{tp_rank}" for k in base_keys] if tp_size > 1 else list(base_keys)
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """:meth:`put_tensor_with_tp` of a full tensor serialized at ``buffer_ptr``."""
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank,
                                                  tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        if not (len(base_keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(base_keys)
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        tensors = [self._tensor_view_at(int(p), int(n)) for p, n in zip(buffer_ptrs, sizes,
                                                                      strict=True)]
        out = [INVALID] * len(base_keys)
        ok = [i for i, t in enumerate(tensors) if t is not None]
        res = self.batch_put_tensor_with_tp([base_keys[i] for i in ok],
                                            [tensors[i] for i in ok], tp_rank, tp_size,
                                            split_dim)
        for i, c in zip(ok, res, strict=True):
            out[i] = c
        return out

    # ------------------------------------------------------------------ unified parallelism

    def _parallel_writes(self, key: str, tensor: Any, parallelism: Any,
                         writer_partition: Any) -> list[_Write]:
        """The objects a parallelism write stores (Mooncake's routes). Raises."""
        if writer_partition is not None:
            if parallelism is not None:
                raise KVPoolError("writer_partition cannot be combined with parallelism",
                                  ErrorCode.INVALID_PARAMS)
            r, n, d = (int(writer_partition.rank), int(writer_partition.size),
                       int(writer_partition.split_dim))
            if n <= 0 or not 0 <= r < n or d < 0:
                raise KVPoolError("invalid writer partition", ErrorCode.INVALID_PARAMS)
            shard = _shard(tensor, d, r, n)
            w = self._tensor_write(shard, f"{key}__writer_{r}of{n}_sd{d}",
                                   [_Axis("tp", r, n, d)], tensor.shape)
            manifest = pack_manifest(dtype_code(tensor.dtype), tensor.shape, d, n)
            return [w, _Write(f"{key}__writer_manifest", [manifest])]
        if parallelism is None:
            return [self._tensor_write(tensor, key)]
        axes = _parse_axes(parallelism)
        tp = _tp(axes)
        if tp is None:  # DP/EP/PP only: the tensor as given, no reshaping
            return [self._tensor_write(tensor, parallel_key(key, axes), axes, tensor.shape)]
        assert tp.split_dim is not None
        if len(axes) == 1:  # plain TP: the caller passes its shard
            full = list(tensor.shape)
            if not 0 <= tp.split_dim < len(full):
                raise KVPoolError("split_dim out of range", ErrorCode.INVALID_PARAMS)
            full[tp.split_dim] *= tp.size
            shard = tensor
        else:  # TP inside a multi-axis layout: the caller passes the full tensor
            full = list(tensor.shape)
            shard = _shard(tensor, tp.split_dim, tp.rank, tp.size)
        w = self._tensor_write(shard, parallel_key(key, axes), axes, full)
        manifest = pack_manifest(dtype_code(tensor.dtype), full, tp.split_dim, tp.size)
        return [w, _Write(f"{key}__parallelism_manifest", [manifest])]

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: ReplicateConfig | None = None,
                                    writer_partition: Any = None) -> int:
        """Store a tensor under Mooncake's parallel layout: ``parallelism`` None
        (and no ``writer_partition``): the full tensor at ``key``; a single TP
        axis: ``tensor`` is that rank's shard (stored as ``key_tp_<rank>``);
        TP in a multi-axis layout: ``tensor`` is full and this rank's shard is
        derived; DP/EP/PP only: stored as given under the axis key;
        ``writer_partition`` (rank, size, split_dim): the writer's shard of a
        full tensor. TP layouts and writer partitions also store a manifest
        for full reads. 0 or a negative code."""
        return self.batch_put_tensor_with_parallelism(
            [key], [tensor], None if parallelism is None else [parallelism], config,
            None if writer_partition is None else [writer_partition])[0]

    def batch_put_tensor_with_parallelism(self, keys: Sequence[str],
                                          tensors_list: Sequence[Any],
                                          parallelisms: Sequence[Any] | None = None,
                                          config: ReplicateConfig | None = None,
                                          writer_partitions: Sequence[Any] | None = None
                                          ) -> list[int]:
        return self._batch_parallel_write(keys, tensors_list, parallelisms, config,
                                          writer_partitions, upsert=False)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: ReplicateConfig | None = None,
                                       writer_partition: Any = None) -> int:
        return self.batch_upsert_tensor_with_parallelism(
            [key], [tensor], None if parallelism is None else [parallelism], config,
            None if writer_partition is None else [writer_partition])[0]

    def batch_upsert_tensor_with_parallelism(self, keys: Sequence[str],
                                             tensors_list: Sequence[Any],
                                             parallelisms: Sequence[Any] | None = None,
                                             config: ReplicateConfig | None = None,
                                             writer_partitions: Sequence[Any] | None = None
                                             ) -> list[int]:
        return self._batch_parallel_write(keys, tensors_list, parallelisms, config,
                                          writer_partitions, upsert=True)

    def _batch_parallel_write(self, keys: Sequence[str], tensors: Sequence[Any],
                              parallelisms: Sequence[Any] | None,
                              config: ReplicateConfig | None,
                              writer_partitions: Sequence[Any] | None,
                              upsert: bool) -> list[int]:
        n = len(keys)
        if len(tensors) != n or (parallelisms is not None and len(parallelisms) != n) \
                or (writer_partitions is not None and len(writer_partitions) != n) \
                or (parallelisms is not None and writer_partitions is not None):
            return [INVALID] * n
        out = [INVALID] * n
        writes: list[_Write | None] = []
        owner: list[int] = []
        for i, (key, t) in enumerate(zip(keys, tensors, strict=True)):
            try:
                objs = self._parallel_writes(
                    key, t, None if parallelisms is None else parallelisms[i],
                    None if writer_partitions is None else writer_partitions[i])
            except (KVPoolError, AttributeError, RuntimeError, TypeError) as exc:
                log.error("tensor write %r: %s", key, exc)
                continue
            out[i] = 0
            writes.extend(objs)
            owner.extend([i] * len(objs))
        if config is not None and config.group_ids is not None:
            config = dataclasses.replace(config, group_ids=[config.group_ids[i] for i in owner])
        for i, c in zip(owner, self._write_objects(writes, config, upsert=upsert), strict=True):
            if c != 0 and out[i] == 0:
                out[i] = c
        return out

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: Any = None,
                                         config: ReplicateConfig | None = None,
                                         writer_partition: Any = None) -> int:
        """:meth:`put_tensor_with_parallelism` of a tensor serialized at
        ``buffer_ptr`` (``[TensorMetadata][data]``)."""
        t = self._tensor_view_at(int(buffer_ptr), int(size))
        if t is None:
            return INVALID
        return self.put_tensor_with_parallelism(key, t, parallelism, config, writer_partition)

    def batch_put_tensor_with_parallelism_from(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int],
                                               parallelisms: Sequence[Any] | None = None,
                                               config: ReplicateConfig | None = None,
                                               writer_partitions: Sequence[Any] | None = None
                                               ) -> list[int]:
        return self._batch_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config,
                                         writer_partitions, upsert=False)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: Any = None,
                                            config: ReplicateConfig | None = None,
                                            writer_partition: Any = None) -> int:
        t = self._tensor_view_at(int(buffer_ptr), int(size))
        if t is None:
            return INVALID
        return self.upsert_tensor_with_parallelism(key, t, parallelism, config,
                                                   writer_partition)

    def batch_upsert_tensor_with_parallelism_from(self, keys: Sequence[str],
                                                  buffer_ptrs: Sequence[int],
                                                  sizes: Sequence[int],
                                                  parallelisms: Sequence[Any] | None = None,
                                                  config: ReplicateConfig | None = None,
                                                  writer_partitions: Sequence[Any] | None = None
                                                  ) -> list[int]:
        return self._batch_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config,
                                         writer_partitions, upsert=True)

    def _batch_parallel_from(self, keys: Sequence[str], ptrs: Sequence[int],
                             sizes: Sequence[int], parallelisms: Sequence[Any] | None,
                             config: ReplicateConfig | None,
                             writer_partitions: Sequence[Any] | None, upsert: bool) -> list[int]:
        if not (len(keys) == len(ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        tensors = [self._tensor_view_at(int(p), int(n)) for p, n in zip(ptrs, sizes, strict=True)]
        ok = [i for i, t in enumerate(tensors) if t is not None]
        out = [INVALID] * len(keys)

        def pick(xs: Sequence[Any] | None) -> list[Any] | None:
            return None if xs is None or len(xs) != len(keys) else [xs[i] for i in ok]

        res = self._batch_parallel_write([keys[i] for i in ok], [tensors[i] for i in ok],
                                         pick(parallelisms), config, pick(writer_partitions),
                                         upsert)
        for i, c in zip(ok, res, strict=True):
            out[i] = c
        return out

    def _read_target(self, key: str, target: Any) -> Any:
        """The tensor a ReadTarget asks for, or None."""
        mode = str(getattr(target, "mode", "as_stored")) if target is not None else "as_stored"
        par = getattr(target, "parallelism", None) if target is not None else None
        if mode == "as_stored":
            return self.get_tensor(key) if par is None else None
        if mode == "full" and par is None:
            return self._full_from_writer(key)
        axes = _parse_axes(par)
        tp = _tp(axes)
        if mode == "shard":
            (obj,) = self._read_objects([parallel_key(key, axes)])
            if obj is not None and _matches(obj[0], axes):
                return tensor_from(obj[0], obj[1])
            if tp is None:
                return None
            assert tp.split_dim is not None
            if len(axes) == 1:  # a single TP shard may have been written by a writer partition
                found = self.get_tensor(f"{key}__writer_{tp.rank}of{tp.size}_sd{tp.split_dim}")
                if found is not None:
                    return found
            full = self._full_from_parallel(key, axes)
            if full is None:
                full = self._full_from_writer(key)
            if full is None:
                return None
            return _shard(full, tp.split_dim, tp.rank, tp.size)
        if mode == "full":
            if tp is None:
                log.error("get_tensor_with_parallelism: full reconstruction requires a TP axis")
                return None
            return self._full_from_parallel(key, axes)
        return None

    def _gather(self, keys: Sequence[str], split_dim: int) -> Any:
        shards = self.batch_get_tensor(keys)
        if any(s is None for s in shards):
            log.error("missing reconstructed shard source among %s", list(keys))
            return None
        return _torch().cat(shards, dim=split_dim)

    def _full_from_writer(self, key: str) -> Any:
        (raw,) = self._read_buffers([f"{key}__writer_manifest"])
        man = parse_manifest(raw)
        if man is None:
            return None
        _dtype, _shape, sd, n = man
        return self._gather([f"{key}__writer_{r}of{n}_sd{sd}" for r in range(n)], sd)

    def _full_from_parallel(self, key: str, axes: Sequence[_Axis]) -> Any:
        (raw,) = self._read_buffers([f"{key}__parallelism_manifest"])
        man = parse_manifest(raw)
        tp = _tp(axes)
        if man is None or tp is None:
            return None
        _dtype, _shape, sd, n = man
        stored = [dataclasses.replace(a, size=n, split_dim=sd) if a.kind == "tp" else a
                  for a in axes]
        return self._gather([parallel_key(key, _with_tp_rank(stored, r)) for r in range(n)], sd)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """Read through a ReadTarget: None/"as_stored": the object at ``key``;
        "shard": the shard ``target.parallelism`` names (its stored key, a
        writer-partition shard, or cut from the reconstructed full tensor);
        "full": the full tensor rebuilt from the stored TP shards (or writer
        partitions when no parallelism is given). None when unavailable."""
        try:
            return self._read_target(key, target)
        except (KVPoolError, RuntimeError, ValueError) as exc:
            log.error("get_tensor_with_parallelism %r: %s", key, exc)
            return None

    def batch_get_tensor_with_parallelism(self, keys: Sequence[str],
                                          targets: Sequence[Any] | None = None) -> list[Any]:
        if targets is not None and len(targets) != len(keys):
            return [None] * len(keys)
        if targets is None or all(t is None for t in targets):
            return self.batch_get_tensor(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets,
                                                                        strict=True)]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """:meth:`get_tensor_with_parallelism`, the result serialized into
        ``[buffer_ptr, +size)`` and returned as a tensor viewing it."""
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size],
                                                           None if target is None else [target])[0]

    def batch_get_tensor_with_parallelism_into(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int],
                                               targets: Sequence[Any] | None = None
                                               ) -> list[Any]:
        if not (len(keys) == len(buffer_ptrs) == len(sizes)) or \
                (targets is not None and len(targets) != len(keys)):
            return [None] * len(keys)
        if targets is None or all(t is None or (getattr(t, "mode", "") == "as_stored"
                                                and getattr(t, "parallelism", None) is None)
                                  for t in targets):
            return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
        out: list[Any] = []
        for key, p, n, t in zip(keys, buffer_ptrs, sizes, targets, strict=True):
            tensor = self.get_tensor_with_parallelism(key, t)
            out.append(None if tensor is None else _place(tensor, int(p), int(n)))
        return out

    # ------------------------------------------------------------------ safetensors

    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor under ``key`` to a safetensors file (``file_name``,
        default the key) holding it under the name ``key``. 0 or negative."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return int(ErrorCode.OBJECT_NOT_FOUND)
        try:
            from safetensors.torch import save_file
        except ImportError:
            log.error("save_tensor_to_safetensor needs the safetensors package")
            return int(ErrorCode.INTERNAL_ERROR)
        try:
            save_file({key: tensor.contiguous()}, file_name or key)
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("save_tensor_to_safetensor %r: %s", key, exc)
            return int(ErrorCode.INTERNAL_ERROR)
        return 0

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Load a tensor from a safetensors file and store it under ``key``
        (default: the file name). The file's entry named ``key`` is used, else
        its first entry (logged). Returns the tensor, or None."""
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
        return tensor if self.put_tensor(target, tensor) == 0 else None


def _place(tensor: Any, ptr: int, size: int) -> Any:
    """Serialize ``tensor`` into host memory at ``ptr`` and view it there."""
    import ctypes

    meta = tensor_meta(tensor)
    total = METADATA_SIZE + meta.data_bytes
    if total > size:
        return None
    ctypes.memmove(ptr, pack_metadata(meta), METADATA_SIZE)
    view = tensor_from(meta, (ctypes.c_uint8 * total).from_address(ptr))
    view.copy_(tensor)
    return view
