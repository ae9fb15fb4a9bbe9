"""Host memory copies split across threads for large sizes.

One thread's memcpy does not saturate memory bandwidth (it is bound by the
latency of its own cache misses); numpy releases the GIL while copying, so
splitting a large copy into a few contiguous parts copied in parallel moves
the same bytes faster. Used by the shm transport and the store's inline path.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["DEFAULT_SPLIT_MIN_BYTES", "parallel_copyto"]

DEFAULT_SPLIT_MIN_BYTES = 4 << 20
_PART_ALIGN = 4096  # parts start on page boundaries (no false sharing of pages)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(1, threads - 1),
                                           thread_name_prefix="kvpool-copy")
    return _pool


@functools.cache
def default_copy_threads() -> int:
    """Copy threads by default: the CPUs this process may use, at most 4."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def parallel_copyto(dst: np.ndarray, src: np.ndarray, threads: int = 0,
                    split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES) -> None:
    """``dst[...] = src`` for flat uint8 arrays of equal size, in ``threads``
    page-aligned parts when the copy is at least ``split_min_bytes``
    (``threads`` 0 = :func:`default_copy_threads`). The calling thread copies
    one part itself; returns when every part is done (exceptions propagate)."""
    n = dst.size
    if n < split_min_bytes:  # the common small copy: no thread bookkeeping at all
        dst[...] = src  # np.copyto's Python-level dispatch costs more than a 4 KiB copy
        return
    threads = threads or default_copy_threads()
    if threads <= 1:
        np.copyto(dst, src)
        return
    part = -(-n // threads)
    part = -(-part // _PART_ALIGN) * _PART_ALIGN
    bounds = [(i, min(i + part, n)) for i in range(0, n, part)]
    pool = _executor(threads)
    futures = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in bounds[1:]]
    a, b = bounds[0]
    np.copyto(dst[a:b], src[a:b])
    for f in futures:
        f.result()
