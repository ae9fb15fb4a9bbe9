"""Mooncake's parallel tensor layouts: TP shards, ``TensorParallelism``, writer partitions.

Keys follow Mooncake: TP shards ``key_tp_<rank>``; parallelism shards
``key__dp_1of2__tp_0of2_sd0`` (axes in DP, TP, EP, PP order); writer
partitions ``key__writer_<r>of<n>_sd<d>``, with a 96-byte manifest at
``key__writer_manifest`` (``key__parallelism_manifest`` for TP layouts)
from which a full read gathers the shards. Only uniform shards are
supported (-600 otherwise, as Mooncake). Every write of a call is one batch
(:meth:`~kvpool.store.mooncake_tensor_calls.TensorCalls.write`); a read
resolves its ``ReadTarget``: the object as stored, a shard (its stored key,
a writer-partition shard, or cut from the reconstructed full tensor), or
the full tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.core.errors import ErrorCode, KVPoolError
from kvpool.store.config import ReplicateConfig
from kvpool.store.mooncake_codes import INVALID, log
from kvpool.store.mooncake_objects import ObjectIO
from kvpool.store.mooncake_tensor import (
    AXIS_KINDS,
    LAYOUT_SHARD,
    MAX_AXES,
    AxisMeta,
    TensorMeta,
    TensorWrite,
    dtype_code,
    pack_manifest,
    parse_manifest,
    place,
    tensor_from,
    tensor_meta,
    torch_module,
)
from kvpool.store.mooncake_tensor_calls import TensorCalls

__all__ = ["ParallelTensorCalls", "tp_keys"]

AXIS_ORDER = ("dp", "tp", "ep", "pp")


def tp_keys(base_keys: Sequence[str], tp_rank: int, tp_size: int) -> list[str]:
    """The keys of TP shard ``tp_rank`` of ``base_keys`` (the keys themselves
    when ``tp_size`` is 1)."""
    return [f"{k}_tp_{tp_rank}" for k in base_keys] if tp_size > 1 else list(base_keys)


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
    ordered = sorted(axes, key=lambda a: AXIS_ORDER.index(a.kind))
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


def _shard_write(key: str, shard: Any, axes: Sequence[_Axis],
                 full_shape: Sequence[int]) -> TensorWrite:
    return TensorWrite.of(key, shard, _shard_meta(full_shape, shard, axes))


def _parallel_writes(key: str, tensor: Any, parallelism: Any,
                     writer_partition: Any) -> list[TensorWrite]:
    """The objects a parallelism write stores (Mooncake's routes). Raises."""
    if writer_partition is not None:
        if parallelism is not None:
            raise KVPoolError("writer_partition cannot be combined with parallelism",
                              ErrorCode.INVALID_PARAMS)
        r, n, d = (int(writer_partition.rank), int(writer_partition.size),
                   int(writer_partition.split_dim))
        if n <= 0 or not 0 <= r < n or d < 0:
            raise KVPoolError("invalid writer partition", ErrorCode.INVALID_PARAMS)
        w = _shard_write(f"{key}__writer_{r}of{n}_sd{d}", _shard(tensor, d, r, n),
                         [_Axis("tp", r, n, d)], tensor.shape)
        manifest = pack_manifest(dtype_code(tensor.dtype), tensor.shape, d, n)
        return [w, TensorWrite(f"{key}__writer_manifest", [manifest])]
    if parallelism is None:
        return [TensorWrite.of(key, tensor, tensor_meta(tensor))]
    axes = _parse_axes(parallelism)
    tp = _tp(axes)
    if tp is None:  # DP/EP/PP only: the tensor as given, no reshaping
        return [_shard_write(parallel_key(key, axes), tensor, axes, tensor.shape)]
    assert tp.split_dim is not None
    full = list(tensor.shape)
    if len(axes) == 1:  # plain TP: the caller passes its shard
        if not 0 <= tp.split_dim < len(full):
            raise KVPoolError("split_dim out of range", ErrorCode.INVALID_PARAMS)
        full[tp.split_dim] *= tp.size
        shard = tensor
    else:  # TP inside a multi-axis layout: the caller passes the full tensor
        shard = _shard(tensor, tp.split_dim, tp.rank, tp.size)
    w = _shard_write(parallel_key(key, axes), shard, axes, full)
    manifest = pack_manifest(dtype_code(tensor.dtype), full, tp.split_dim, tp.size)
    return [w, TensorWrite(f"{key}__parallelism_manifest", [manifest])]


class ParallelTensorCalls:
    """The TP and parallel-layout tensor calls of one store (module docstring)."""

    def __init__(self, io: ObjectIO, tensors: TensorCalls) -> None:
        self._io = io
        self._tensors = tensors

    # ------------------------------------------------------------------ writes

    def put_with_tp(self, keys: Sequence[str], tensors: Sequence[Any],
                    config: ReplicateConfig | None, tp_size: int,
                    split_dim: int) -> list[int]:
        """Split each tensor into ``tp_size`` equal shards along ``split_dim``
        and store them as ``key_tp_<rank>``, all in one batch (``tp_size`` 1:
        the whole tensor at ``key``). Per key 0 or the first shard's code
        (-600 for non-uniform sharding or a None tensor)."""
        if tp_size <= 1:
            return self._tensors.put(keys, tensors, config, upsert=False)
        if len(keys) != len(tensors) or not keys:
            return [INVALID] * len(keys)
        objects: list[list[TensorWrite] | None] = []
        for key, t in zip(keys, tensors, strict=True):
            try:
                objects.append(None if t is None else [
                    _shard_write(f"{key}_tp_{r}", _shard(t, split_dim, r, tp_size),
                                 [_Axis("tp", r, tp_size, split_dim)], t.shape)
                    for r in range(tp_size)])
            except (KVPoolError, AttributeError, RuntimeError) as exc:
                log.error("put_tensor_with_tp %r: %s", key, exc)
                objects.append(None)
        return self._tensors.write(objects, config, upsert=False)

    def put_with_tp_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                         sizes: Sequence[int], tp_size: int, split_dim: int) -> list[int]:
        """:meth:`put_with_tp` of full tensors serialized in caller memory."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        if tp_size <= 1:
            return self._tensors.put_from(keys, buffer_ptrs, sizes, upsert=False)
        return self.put_with_tp(keys, self._tensors.views_at(buffer_ptrs, sizes), None,
                                tp_size, split_dim)

    def put(self, keys: Sequence[str], tensors: Sequence[Any],
            parallelisms: Sequence[Any] | None, config: ReplicateConfig | None,
            writer_partitions: Sequence[Any] | None, upsert: bool) -> list[int]:
        """Store tensors under Mooncake's parallel layouts, all in one batch:
        per key, no parallelism (and no writer partition): the full tensor at
        ``key``; a single TP axis: the tensor is that rank's shard; TP in a
        multi-axis layout: the tensor is full and this rank's shard is
        derived; DP/EP/PP only: stored as given under the axis key; a writer
        partition (rank, size, split_dim): the writer's shard of a full
        tensor. TP layouts and writer partitions also store a manifest. Per
        key 0 or a Mooncake code (every key -600 on lists of different
        lengths, or with both parallelisms and writer partitions)."""
        n = len(keys)
        if len(tensors) != n or (parallelisms is not None and len(parallelisms) != n) \
                or (writer_partitions is not None and len(writer_partitions) != n) \
                or (parallelisms is not None and writer_partitions is not None):
            return [INVALID] * n
        objects: list[list[TensorWrite] | None] = []
        for i, (key, t) in enumerate(zip(keys, tensors, strict=True)):
            try:
                objects.append(None if t is None else _parallel_writes(
                    key, t, None if parallelisms is None else parallelisms[i],
                    None if writer_partitions is None else writer_partitions[i]))
            except (KVPoolError, AttributeError, RuntimeError, TypeError) as exc:
                log.error("tensor write %r: %s", key, exc)
                objects.append(None)
        return self._tensors.write(objects, config, upsert)

    def put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                 parallelisms: Sequence[Any] | None, config: ReplicateConfig | None,
                 writer_partitions: Sequence[Any] | None, upsert: bool) -> list[int]:
        """:meth:`put` of tensors serialized in caller memory (-600 where one
        is not a valid serialized tensor)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID] * len(keys)
        return self.put(keys, self._tensors.views_at(buffer_ptrs, sizes), parallelisms, config,
                        writer_partitions, upsert)

    # ------------------------------------------------------------------ reads

    def get(self, keys: Sequence[str], targets: Sequence[Any] | None) -> list[Any]:
        """Each key read through its ReadTarget (:meth:`_read_target`); None
        where unavailable (every key on lists of different lengths)."""
        if targets is not None and len(targets) != len(keys):
            return [None] * len(keys)
        if targets is None or all(t is None for t in targets):
            return self._tensors.get(keys)
        return [self._get_one(k, t) for k, t in zip(keys, targets, strict=True)]

    def get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                 targets: Sequence[Any] | None) -> list[Any]:
        """:meth:`get`, each result serialized into ``[buffer_ptrs[i],
        +sizes[i])`` and returned as a tensor viewing it (None where it does
        not fit or is unavailable)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)) or \
                (targets is not None and len(targets) != len(keys)):
            return [None] * len(keys)
        if targets is None or all(t is None or (getattr(t, "mode", "") == "as_stored"
                                                and getattr(t, "parallelism", None) is None)
                                  for t in targets):
            return self._tensors.get_into(keys, buffer_ptrs, sizes)
        out: list[Any] = []
        for key, p, n, t in zip(keys, buffer_ptrs, sizes, targets, strict=True):
            tensor = self._get_one(key, t)
            out.append(None if tensor is None else place(tensor, int(p), int(n)))
        return out

    def _get_one(self, key: str, target: Any) -> Any:
        try:
            return self._read_target(key, target)
        except (KVPoolError, RuntimeError, ValueError) as exc:
            log.error("get_tensor_with_parallelism %r: %s", key, exc)
            return None

    def _read_target(self, key: str, target: Any) -> Any:
        """The tensor a ReadTarget asks for, or None: None/"as_stored": the
        object at ``key``; "shard": the shard ``target.parallelism`` names;
        "full": the full tensor rebuilt from the stored TP shards (or writer
        partitions when no parallelism is given)."""
        mode = str(getattr(target, "mode", "as_stored")) if target is not None else "as_stored"
        par = getattr(target, "parallelism", None) if target is not None else None
        if mode == "as_stored":
            return self._tensors.get([key])[0] if par is None else None
        if mode == "full" and par is None:
            return self._full_from_writer(key)
        axes = _parse_axes(par)
        tp = _tp(axes)
        if mode == "shard":
            (obj,) = self._tensors.objects([parallel_key(key, axes)])
            if obj is not None and _matches(obj[0], axes):
                return tensor_from(obj[0], obj[1])
            if tp is None:
                return None
            assert tp.split_dim is not None
            if len(axes) == 1:  # a single TP shard may have been written by a writer partition
                (found,) = self._tensors.get(
                    [f"{key}__writer_{tp.rank}of{tp.size}_sd{tp.split_dim}"])
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
        shards = self._tensors.get(keys)
        if any(s is None for s in shards):
            log.error("missing reconstructed shard source among %s", list(keys))
            return None
        return torch_module().cat(shards, dim=split_dim)

    def _full_from_writer(self, key: str) -> Any:
        (raw,) = self._io.read([f"{key}__writer_manifest"])
        man = parse_manifest(raw)
        if man is None:
            return None
        _dtype, _shape, sd, n = man
        return self._gather([f"{key}__writer_{r}of{n}_sd{sd}" for r in range(n)], sd)

    def _full_from_parallel(self, key: str, axes: Sequence[_Axis]) -> Any:
        (raw,) = self._io.read([f"{key}__parallelism_manifest"])
        man = parse_manifest(raw)
        tp = _tp(axes)
        if man is None or tp is None:
            return None
        _dtype, _shape, sd, n = man
        stored = [dataclasses.replace(a, size=n, split_dim=sd) if a.kind == "tp" else a
                  for a in axes]
        return self._gather([parallel_key(key, _with_tp_rank(stored, r)) for r in range(n)], sd)
