"""parallel_copyto: every byte lands, for sizes around the split points."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.transfer.copy import parallel_copyto


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, (4 << 20) - 1, 4 << 20, (9 << 20) + 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_copy_is_exact(n: int, threads: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 2, np.uint8)  # guard bytes on both sides stay untouched
    parallel_copyto(dst[1:n + 1], src, threads=threads, split_min_bytes=4096)
    assert dst[0] == 0 and dst[-1] == 0
    assert np.array_equal(dst[1:n + 1], src)


def test_mismatched_sizes_raise() -> None:
    with pytest.raises(ValueError):
        parallel_copyto(np.zeros(8 << 20, np.uint8), np.zeros(4 << 20, np.uint8), threads=2,
                        split_min_bytes=1)
