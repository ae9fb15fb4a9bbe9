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

The calls that store and read these objects are in
:mod:`~kvpool.store.mooncake_tensor_calls` (whole tensors) and
:mod:`~kvpool.store.mooncake_tensor_parallel` (TP shards, parallel layouts,
writer partitions). Tensors may be CPU or CUDA (the transfer engine moves
GPU memory; metadata stays on the host).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError

__all__ = [
    "AXIS_KINDS",
    "LAYOUT_SHARD",
    "MAX_AXES",
    "METADATA_SIZE",
    "AxisMeta",
    "TensorMeta",
    "TensorWrite",
    "_deserialize_tensor",
    "_serialize_tensor",
    "_tensor_metadata_size",
    "dtype_code",
    "is_tensor",
    "pack_manifest",
    "pack_metadata",
    "parse_manifest",
    "parse_metadata",
    "payload",
    "place",
    "tensor_at",
    "tensor_from",
    "tensor_meta",
    "torch_module",
]

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
# Mooncake's TensorDtype codes, by torch dtype name
DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
          "int64", "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def torch_module() -> Any:
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
    return getattr(torch_module(), DTYPES[code])


def is_tensor(obj: Any) -> bool:
    # Mooncake's test: the object's class name contains "Tensor"
    return "Tensor" in type(obj).__name__ and hasattr(obj, "data_ptr")


def payload(tensor: Any) -> Any:
    """The tensor's bytes as a flat uint8 tensor (no copy when contiguous)."""
    t = tensor.contiguous()
    return t.reshape(-1).view(torch_module().uint8)


def tensor_meta(tensor: Any, axes: Sequence[AxisMeta] = (),
                global_shape: Sequence[int] | None = None) -> TensorMeta:
    """The metadata of a full tensor (no axes) or of a shard. Raises KVPoolError."""
    if not is_tensor(tensor):
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
    torch = torch_module()
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


@dataclass
class TensorWrite:
    """One object of a tensor write: its key and parts (metadata, data)."""

    key: str
    parts: list[Any]

    @classmethod
    def of(cls, key: str, tensor: Any, meta: TensorMeta) -> TensorWrite:
        """The object storing ``tensor`` (described by ``meta``) at ``key``."""
        parts: list[Any] = [pack_metadata(meta)]
        if meta.data_bytes:
            parts.append(payload(tensor))
        return cls(key, parts)


def tensor_at(ptr: int, length: int) -> Any:
    """A tensor viewing the serialized tensor of ``length`` bytes at host
    address ``ptr``, or None when it is not one."""
    raw = (ctypes.c_uint8 * length).from_address(ptr)
    meta = parse_metadata(memoryview(raw), length)
    return None if meta is None else tensor_from(meta, raw)


def place(tensor: Any, ptr: int, size: int) -> Any:
    """Serialize ``tensor`` into host memory at ``ptr`` and view it there."""
    meta = tensor_meta(tensor)
    total = METADATA_SIZE + meta.data_bytes
    if total > size:
        return None
    ctypes.memmove(ptr, pack_metadata(meta), METADATA_SIZE)
    view = tensor_from(meta, (ctypes.c_uint8 * total).from_address(ptr))
    view.copy_(tensor)
    return view
