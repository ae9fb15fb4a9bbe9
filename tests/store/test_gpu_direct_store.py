"""GPU buffers through the store to same-host shm segments (the shm transport's
CUDA copies: one wait per call).

No GPU here: :class:`support.cuda_double.HostCudaDouble` stands in for the
CUDA runtime (hardware this machine lacks; copies are memmoves), so these
check the store's side for real (real master, node daemons and their shm
segments): single and batch puts of "GPU" buffers, reads back, a pipelined
read part by part, per-key codes, every byte compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.store import Client
from kvpool.transfer.buffers import BufferHandle
from support.cuda_double import HostCudaDouble


def _dev(arr: np.ndarray, off: int = 0, n: int | None = None) -> BufferHandle:
    n = arr.size - off if n is None else n
    return BufferHandle(ptr=int(arr.ctypes.data) + off, length=n, device="cuda", owner=arr)


def test_gpu_puts_and_reads_go_direct(cuda_double: HostCudaDouble, daemons: Any,
                                      make_client: Callable[..., Client],
                                      key: Callable[[str], str]) -> None:
    c = make_client()
    rng = np.random.default_rng(5)
    n = 64 << 10
    vals = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(5)]
    c.put_from(key("single"), _dev(vals[0]))
    keys = [key(f"b{i}") for i in range(4)]
    syncs = len(cuda_double.syncs)
    assert c.batch_put_from(keys, [_dev(v) for v in vals[1:]]) == [ErrorCode.OK] * 4
    assert cuda_double.async_copies and len(cuda_double.syncs) == syncs + 1  # one wait
    out = np.zeros(n, np.uint8)
    assert c.get_into(key("single"), _dev(out)) == n
    assert np.array_equal(out, vals[0])
    # a pipelined read: part by part, results per part in the part's order
    staging = np.zeros(4 * n, np.uint8)
    seen: list[tuple[int, list[int]]] = []
    all_keys = [*keys, key("missing")]
    bufs = [_dev(staging, i * n, n) for i in range(4)] + [_dev(np.zeros(n, np.uint8))]
    res = c.batch_get_into_parts(all_keys, bufs, [[1, 0], [4, 2, 3]],
                                 lambda p, r: seen.append((p, r)))
    assert seen == [(0, [n, n]), (1, [int(ErrorCode.OBJECT_NOT_FOUND), n, n])]
    assert res[:4] == [n] * 4 and res[4] == int(ErrorCode.OBJECT_NOT_FOUND)
    for i in range(4):
        assert np.array_equal(staging[i * n:(i + 1) * n], vals[i + 1])
    # a "GPU" buffer too small for its object: BUFFER_OVERFLOW, the rest still read
    small = _dev(np.zeros(n // 2, np.uint8))
    assert c.batch_get_into(keys[:2], [small, _dev(out)]) == [
        int(ErrorCode.BUFFER_OVERFLOW), n]
    assert np.array_equal(out, vals[2])
    assert len(cuda_double.syncs) >= 5
