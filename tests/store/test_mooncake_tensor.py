"""The tensor API of kvpool.store.mooncake, against Mooncake's object layout.

mooncake_tensor_golden.json holds objects written by Mooncake 0.3.13.post1
itself (``put_tensor``, ``put_tensor_with_tp``, writer partitions, a DP x TP
parallel shard and the manifests). kvpool must read each of them back as the
same tensor, and write byte-identical objects for the same calls, so either
library reads what the other wrote. Needs torch (CPU); CUDA tensors are
checked on the GPU machine by scripts/gpu_check_mooncake.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.errors import ErrorCode
from kvpool.store.mooncake import (
    MooncakeDistributedStore,
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)

GOLDEN = json.loads((Path(__file__).parent / "mooncake_tensor_golden.json").read_text())
INVALID = int(ErrorCode.INVALID_PARAMS)


def golden_tensors() -> dict[str, Any]:
    """The tensors the golden objects were made from (same expressions)."""
    return {
        "f32_2x3": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4,
        "bf16_3x4": (torch.arange(12, dtype=torch.float32) - 5).reshape(3, 4).to(torch.bfloat16),
        "bool_5": torch.tensor([True, False, True, True, False]),
        "i64_2x2x2": torch.arange(8, dtype=torch.int64).reshape(2, 2, 2) * -3,
        "f16_empty": torch.empty(0, 3, dtype=torch.float16),
        "u8_7": torch.arange(7, dtype=torch.uint8) * 31,
    }


T = torch.arange(24, dtype=torch.int32).reshape(4, 6)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    d = tmp_path_factory.mktemp("mc-tensor-master")
    with MasterProcess(data_dir=str(d), lease_ttl_ms=500, client_ttl_s=3) as m:
        yield m


@pytest.fixture
def store(master: MasterProcess) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 32 << 20, 32 << 20, "tcp", "",
                   master.address) == 0
    yield s
    s.remove_all(True)
    assert s.close() == 0


def same(a: Any, b: Any) -> bool:
    return a is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) \
        and torch.equal(a, b)


class WP:
    def __init__(self, rank: int, size: int, split_dim: int) -> None:
        self.rank, self.size, self.split_dim = rank, size, split_dim


def axis(kind: str, rank: int, size: int, split_dim: int | None = None,
         expert_id: int | None = None) -> ParallelAxis:
    return ParallelAxis(kind, rank, size, split_dim, expert_id)


def par(*axes: ParallelAxis) -> TensorParallelism:
    return TensorParallelism(list(axes))


def target(mode: str, p: TensorParallelism | None = None) -> ReadTarget:
    t = ReadTarget()
    t.mode = mode
    t.parallelism = p
    return t


# ---------------------------------------------------------------------- layout


def test_kvpool_writes_mooncakes_bytes_and_reads_mooncakes_objects(
        store: MooncakeDistributedStore) -> None:
    objs = GOLDEN["objects"]
    for name, t in golden_tensors().items():
        # Mooncake wrote it: kvpool reads the tensor back
        assert store.put("mc/" + name, bytes.fromhex(objs[name])) == 0
        assert same(store.get_tensor("mc/" + name), t), name
        # kvpool writes it: the same bytes Mooncake wrote
        assert store.put_tensor("kv/" + name, t) == 0
        assert store.get("kv/" + name).hex() == objs[name], name
    assert store.put_tensor_with_tp("tp", T, 0, 2, 1) == 0
    for r in range(2):
        assert store.get(f"tp_tp_{r}").hex() == objs[f"tp_tp_{r}"]
        assert same(store.get_tensor_with_tp("tp", r, 2), T[:, 3 * r:3 * r + 3])
    assert store.put_tensor_with_parallelism("wp", T, writer_partition=WP(1, 2, 0)) == 0
    for k in ("wp__writer_1of2_sd0", "wp__writer_manifest"):
        assert store.get(k).hex() == objs[k], k
    p = par(axis("tp", 0, 2, 0), axis("dp", 1, 2))
    assert store.put_tensor_with_parallelism("mx", T, parallelism=p) == 0
    for k in ("mx__dp_1of2__tp_0of2_sd0", "mx__parallelism_manifest"):
        assert store.get(k).hex() == objs[k], k


def test_module_serializers_match_the_layout() -> None:
    t = golden_tensors()["bf16_3x4"]
    meta, ptr, size, owner = _serialize_tensor(t)
    assert len(meta) == _tensor_metadata_size() == 304 and size == 24 and ptr == owner.data_ptr()
    assert meta.hex() == GOLDEN["objects"]["bf16_3x4"][:608]
    assert same(_deserialize_tensor(bytes.fromhex(GOLDEN["objects"]["bf16_3x4"])), t)
    with pytest.raises(ValueError):
        _deserialize_tensor(b"\x00" * 400)
    with pytest.raises(ValueError):
        _serialize_tensor(np.zeros(3))


# ---------------------------------------------------------------------- full tensors


def test_put_get_batch_and_dtypes(store: MooncakeDistributedStore) -> None:
    tensors = [torch.randn(16, 8), torch.randint(-9, 9, (5, 7), dtype=torch.int16),
               torch.randn(3, 3).to(torch.float8_e4m3fn), torch.tensor(2.5),
               torch.randn(8, 8)[:, ::2]]  # non-contiguous: stored contiguous
    keys = [f"t{i}" for i in range(len(tensors))]
    assert store.batch_put_tensor(keys, tensors) == [0] * len(keys)
    got = store.batch_get_tensor([*keys, "missing"])
    assert got[-1] is None
    for a, b in zip(got, tensors, strict=False):
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
        raw = b.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a.reshape(-1).view(torch.uint8), raw)
    assert store.put_tensor("bad", [1, 2, 3]) == INVALID
    assert store.batch_put_tensor(["a", "b"], [torch.ones(1)]) == [INVALID, INVALID]
    assert store.upsert_tensor("t0", torch.zeros(2)) == 0 and same(store.get_tensor("t0"),
                                                                    torch.zeros(2))


def test_into_and_from_caller_buffers(store: MooncakeDistributedStore) -> None:
    t = torch.randn(64, 32)
    assert store.put_tensor("src", t) == 0
    buf = np.zeros(304 + t.numel() * 4 + 64, np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    view = store.get_tensor_into("src", buf.ctypes.data, buf.nbytes)
    assert same(view, t) and view.data_ptr() == buf.ctypes.data + 304  # in the caller's buffer
    assert store.get_tensor_into("missing", buf.ctypes.data, buf.nbytes) is None
    # the buffer now holds [metadata][data]: store it again from there
    assert store.put_tensor_from("copy", buf.ctypes.data, 304 + t.numel() * 4) == 0
    assert same(store.get_tensor("copy"), t)
    junk = np.ones(400, np.uint8)
    assert store.put_tensor_from("junk", junk.ctypes.data, junk.nbytes) == INVALID
    assert store.batch_get_tensor_into(["src"], [buf.ctypes.data], []) == [INVALID]
    dst = torch.zeros(64, 32)  # straight into a tensor (a CUDA tensor on the GPU machine)
    assert store.get_tensor_into_cuda("src", dst) == t.numel() * 4 and torch.equal(dst, t)
    assert store.get_tensor_into_cuda("src", torch.zeros(3)) == INVALID  # shape mismatch


# ---------------------------------------------------------------------- parallel layouts


def test_tp_shards(store: MooncakeDistributedStore) -> None:
    a, b = torch.randn(8, 4), torch.randn(4, 8)
    assert store.batch_put_tensor_with_tp(["a", "b"], [a, b], tp_size=4, split_dim=0) == [0, 0]
    assert [same(x, a[2 * r:2 * r + 2]) for r, x in
            enumerate(store.batch_get_tensor_with_tp(["a"] * 1, 0, 4))] == [True]
    shards = [store.get_tensor_with_tp("b", r, 4) for r in range(4)]
    assert same(torch.cat(shards, 0), b)
    assert store.put_tensor_with_tp("odd", torch.arange(10).reshape(5, 2), 0, 2, 0) == INVALID
    assert store.get_tensor_with_tp("never", 0, 2) is None
    # from a serialized full tensor in caller memory
    buf = np.zeros(304 + a.numel() * 4, np.uint8)
    assert store.put_tensor("full_a", a) == 0
    assert store.get_tensor_into("full_a", buf.ctypes.data, buf.nbytes) is not None
    assert store.put_tensor_with_tp_from("fa", buf.ctypes.data, buf.nbytes, 0, 2, 1) == 0
    assert same(store.get_tensor_with_tp("fa", 1, 2), a[:, 2:4].contiguous())


def test_unified_parallelism_routes(store: MooncakeDistributedStore) -> None:
    # writer partitions: every rank writes its part; full read gathers them
    assert store.put_tensor_with_parallelism("w", T, writer_partition=WP(1, 2, 0)) == 0
    assert store.get_tensor_with_parallelism("w", target("full")) is None  # rank 0 missing
    assert store.put_tensor_with_parallelism("w", T, writer_partition=WP(0, 2, 0)) == 0
    assert same(store.get_tensor_with_parallelism("w", target("full")), T)
    # a TP shard read served from writer-partition storage
    assert same(store.get_tensor_with_parallelism("w", target("shard", par(axis("tp", 1, 2, 0)))),
                T[2:4])
    # single-axis TP: the caller writes its shard; reads reshard (2 -> 3 ranks) and gather
    for r in range(2):
        rc = store.put_tensor_with_parallelism("p", T[:, 3 * r:3 * r + 3].contiguous(),
                                               parallelism=par(axis("tp", r, 2, 1)))
        assert rc == 0
    got = store.get_tensor_with_parallelism("p", target("shard", par(axis("tp", 0, 3, 1))))
    assert same(got, T[:, 0:2].contiguous())
    assert same(store.get_tensor_with_parallelism("p", target("full", par(axis("tp", 0, 2, 1)))),
                T)
    assert store.get_tensor_with_parallelism("p", None) is None  # nothing stored at "p" itself
    # DP x TP: full input, this rank's TP shard derived and stored under the axis key
    assert store.put_tensor_with_parallelism("q", T, parallelism=par(
        axis("tp", 0, 2, 0), axis("dp", 1, 2))) == 0
    assert store.is_exist("q__dp_1of2__tp_0of2_sd0") == 1
    # DP / EP only: stored as given
    assert store.batch_put_tensor_with_parallelism(
        ["r", "e"], [T, T], [par(axis("dp", 0, 2)), par(axis("ep", 0, 4, expert_id=3))]) == [0, 0]
    assert store.batch_is_exist(["r__dp_0of2", "e__ep_0of4_eid3"]) == [1, 1]
    got = store.batch_get_tensor_with_parallelism(["r"], [target("shard", par(axis("dp", 0, 2)))])
    assert same(got[0], T)
    # invalid requests: -600
    assert store.put_tensor_with_parallelism("x", T, parallelism=par(axis("tp", 0, 2))) == INVALID
    assert store.put_tensor_with_parallelism("x", T, par(axis("dp", 0, 2)),
                                             writer_partition=WP(0, 2, 0)) == INVALID
    # into a caller buffer
    buf = np.zeros(1024, np.uint8)
    view = store.get_tensor_with_parallelism_into("w", buf.ctypes.data, buf.nbytes,
                                                  target("full"))
    assert same(view, T) and view.data_ptr() == buf.ctypes.data + 304


def test_safetensors_export_and_import(store: MooncakeDistributedStore, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("safetensors")
    monkeypatch.chdir(tmp_path)
    t = torch.randn(4, 4)
    assert store.put_tensor("st", t) == 0
    assert store.save_tensor_to_safetensor("st", "st.safetensors") == 0
    assert store.save_tensor_to_safetensor("nope") == int(ErrorCode.OBJECT_NOT_FOUND)
    back = store.load_tensor_from_safetensor("st2", "st.safetensors")  # first entry is used
    assert same(back, t) and same(store.get_tensor("st2"), t)


