"""Unit tests: the per-segment offset allocator."""

from __future__ import annotations

import random

import pytest

from kvpool.core.errors import KVPoolError
from kvpool.master.allocator import Allocator


def test_alignment_and_exhaustion() -> None:
    a = Allocator(1000, alignment=64)
    assert a.capacity == 960  # rounded down to the alignment
    offs = [a.allocate(1) for _ in range(15)]
    assert offs == [i * 64 for i in range(15)]
    assert a.allocate(1) == -1
    assert a.used == 960 and a.free_bytes == 0
    a.check()


def test_coalescing_restores_one_block() -> None:
    a = Allocator(64 * 10, alignment=64)
    offs = [a.allocate(64) for _ in range(10)]
    for i in (1, 3, 5, 7, 9, 0, 2, 4, 6, 8):  # frees in an order that needs both merges
        a.release(offs[i], 64)
        a.check()
    assert a.free_blocks == 1 and a.largest_free == 640 and a.used == 0
    assert a.fragmentation() == 0.0


def test_best_fit_and_fragmentation() -> None:
    a = Allocator(4096, alignment=64)
    x = a.allocate(1024)
    y = a.allocate(64)
    z = a.allocate(256)
    a.allocate(64)
    a.release(x, 1024)
    a.release(z, 256)
    assert a.fragmentation() > 0
    # best fit: a 200-byte request takes the 256 hole, not the 1024 one
    assert a.allocate(200) == z
    assert a.allocate(1024) == x
    assert y == 1024
    a.check()


def test_double_free_and_bad_ranges_rejected() -> None:
    a = Allocator(4096, alignment=64)
    off = a.allocate(128)
    a.release(off, 128)
    with pytest.raises(KVPoolError):
        a.release(off, 128)
    with pytest.raises(KVPoolError):
        a.release(5000, 64)
    with pytest.raises(KVPoolError):
        a.release(3, 64)
    a.check()


def test_reserve_carves_exact_ranges() -> None:
    a = Allocator(64 * 8, alignment=64)
    a.reserve(128, 100)  # takes [128, 256)
    a.reserve(0, 64)
    a.check()
    assert a.used == 192
    with pytest.raises(KVPoolError):
        a.reserve(192, 64)  # overlaps
    assert a.allocate(64) == 64
    a.release(128, 100)
    a.check()


def test_file_alignment_4k() -> None:
    a = Allocator(1 << 20, alignment=4096)
    offs = [a.allocate(5000) for _ in range(3)]
    assert all(o % 4096 == 0 for o in offs)
    assert offs[1] - offs[0] == 8192


def test_random_alloc_free_stays_consistent() -> None:
    rng = random.Random(7)
    a = Allocator(1 << 20, alignment=64)
    live: list[tuple[int, int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off, size = live.pop(rng.randrange(len(live)))
            a.release(off, size)
        else:
            size = rng.randint(1, 20000)
            off = a.allocate(size)
            if off >= 0:
                # no overlap with anything live
                for o, s in live:
                    assert off + a.aligned(size) <= o or o + a.aligned(s) <= off
                live.append((off, size))
    a.check()
    assert a.used == sum(a.aligned(s) for _, s in live)
    for off, size in live:
        a.release(off, size)
    a.check()
    assert a.used == 0 and a.free_blocks == 1
