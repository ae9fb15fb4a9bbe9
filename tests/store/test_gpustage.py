"""Copy planning of the device staging (kvpool.store._gpustage), executed on
host memory: every byte lands where the per-part copies would put it, and
regular layouts collapse into one 2-D copy per part position."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.store._gpustage import Copy2D, plan_copies


def _run(plan: list[Copy2D], mem: np.ndarray) -> None:
    """Execute ``plan`` with offsets into ``mem`` (cudaMemcpy2D semantics)."""
    for c in plan:
        assert c.width > 0 and c.height > 0
        if c.height > 1:
            assert c.dpitch >= c.width and c.spitch >= c.width
        for r in range(c.height):
            d, s = c.dst + r * c.dpitch, c.src + r * c.spitch
            mem[d:d + c.width] = mem[s:s + c.width]


def _naive(per_key: list[list[tuple[int, int, int]]], mem: np.ndarray) -> None:
    for copies in per_key:
        for d, s, n in copies:
            mem[d:d + n] = mem[s:s + n]


def test_vllm_layout_is_one_2d_copy_per_part_position() -> None:
    """K/V-first per-layer caches, one key per block: staged key after key."""
    layers, blocks, bb, keys = 3, 10, 64, 6
    cache = 0  # layer l, kv at cache + (l*2 + kv) * blocks * bb, block b at + b * bb
    stage = 2 * layers * blocks * bb
    per_key = []
    for k in range(keys):
        at = stage + k * 2 * layers * bb
        per_key.append([(at + j * bb, cache + j * blocks * bb + (k + 2) * bb, bb)
                        for j in range(2 * layers)])
    plan = plan_copies(per_key)
    assert len(plan) == 2 * layers and {c.height for c in plan} == {keys}
    mem = np.random.default_rng(1).integers(0, 256, stage + keys * 2 * layers * bb,
                                            dtype=np.uint8)
    want = mem.copy()
    _naive(per_key, want)
    _run(plan, mem)
    assert (mem == want).all()


def test_adjacent_parts_merge_and_scatter_direction() -> None:
    """Parts that continue each other in the source become one copy; the
    reverse direction (staging -> parts) plans the same way."""
    per_key = [[(1000 + k * 300, k * 300, 100), (1100 + k * 300, k * 300 + 100, 200)]
               for k in range(4)]
    plan = plan_copies(per_key)
    assert plan == [Copy2D(1000, 300, 0, 300, 300, 4)]
    back = [[(s, d, n) for d, s, n in copies] for copies in per_key]
    mem = np.random.default_rng(2).integers(0, 256, 2300, dtype=np.uint8)
    want = mem.copy()
    _naive(back, want)
    _run(plan_copies(back), mem)
    assert (mem == want).all()


@pytest.mark.parametrize("seed", range(20))
def test_irregular_layouts_copy_every_byte_once(seed: int) -> None:
    """Random part counts, sizes and placements (including zero-length parts,
    negative and overlapping strides between keys): the plan equals the
    part-by-part copies."""
    rng = np.random.default_rng(seed)
    size = 1 << 16
    per_key: list[list[tuple[int, int, int]]] = []
    dst = size // 2  # destinations: one contiguous run per key, keys back to back
    for _ in range(int(rng.integers(1, 8))):
        copies = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.choice([0, 16, 16, 48, int(rng.integers(1, 200))]))
            src = int(rng.integers(0, size // 2 - n)) if rng.random() < 0.6 else \
                (copies[-1][1] + copies[-1][2] if copies else 0)
            copies.append((dst, src, n))
            dst += n
        per_key.append(copies)
    mem = rng.integers(0, 256, size, dtype=np.uint8)
    want = mem.copy()
    _naive(per_key, want)
    plan = plan_copies(per_key)
    assert sum(c.width * c.height for c in plan) == sum(n for ks in per_key for *_, n in ks)
    _run(plan, mem)
    assert (mem == want).all()
