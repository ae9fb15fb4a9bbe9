"""Unit tests: the read-lease grace of a promoted HA leader
(``Directory.lease_grace_until``; end to end in test_ha_serving.py).

Until the grace ends every object counts as read-leased, whatever its own
lease: no non-forced removal of any kind, no eviction, and space an upsert
replaced is held until then. Time is a controllable clock.
"""

from __future__ import annotations

import re

from kvpool.core.errors import ErrorCode
from kvpool.master.directory import Directory, SegState
from support.clock import Clock
from support.directory import MEM, make, mount, put

OBJ = 1024


def _full_directory() -> tuple[Directory, Clock]:
    d, clock = make(lease_ttl_ms=2000, eviction_high_watermark=0.9, eviction_ratio=0.2)
    mount(d, "s", 10 * OBJ)
    for i in range(8):
        assert put(d, f"k{i}", OBJ) == 0  # 80 %: below the watermark, never read
    return d, clock


def test_every_object_counts_as_leased_until_the_grace_ends() -> None:
    d, clock = _full_directory()
    d.objects.lease_grace_until = clock.t + d.lease_s  # promoted now
    assert d.remove("k0") == ErrorCode.OBJECT_HAS_LEASE
    assert d.removal.clear_many("c1", ["k1"])[0] == ErrorCode.OBJECT_HAS_LEASE
    assert d.removal.clear_many("c1", ["k1"], "s")[0] == ErrorCode.OBJECT_HAS_LEASE
    assert d.removal.remove_matching(None) == 0
    assert d.removal.remove_matching(re.compile("").search, prefix="k") == 0
    # eviction frees nothing: a put that needs room fails, the watermark
    # eviction is not left spinning
    assert put(d, "big", 4 * OBJ) != 0
    assert put(d, "fits", OBJ) == 0  # 90 %: no eviction needed
    assert put(d, "over", OBJ // 2) == 0  # above the watermark: eviction would start
    assert d.evictor.step() == 0 and not d.evictor.evicting
    assert len(d.objects) == 10 and d.evictor.evictions == 0
    # an upsert replaces at once; the old bytes are held until the grace ends
    used = d.pool_used[MEM]
    assert put(d, "k3", OBJ // 4, replace=True) == 0  # what room is left
    assert d.pool_used[MEM] == used + OBJ // 4
    # force still removes; its bytes are held until the grace ends too (READ
    # grants of the former leader may still name them)
    assert d.remove("k0", force=True) == 0 and "k0" not in d.objects
    assert d.pool_used[MEM] == used + OBJ // 4
    d.writes.sweep()
    assert d.pool_used[MEM] == used + OBJ // 4
    # the grace ends: every check is back to the objects' own leases
    clock.t = d.objects.lease_grace_until + 0.001
    d.writes.sweep()  # frees held space whose time has come (old k3, k0)
    assert d.pool_used[MEM] == used + OBJ // 4 - 2 * OBJ
    assert d.remove("k1") == 0
    assert d.removal.clear_many("c1", ["k2"])[0] == 0
    assert put(d, "big", 4 * OBJ) == 0  # evicts
    assert d.evictor.evictions > 0
    assert d.removal.remove_matching(None) > 0


def test_the_grace_does_not_shorten_a_longer_lease() -> None:
    d, clock = _full_directory()
    assert d.get_replicas("k0")[0] == 0  # leased for lease_s from now
    d.objects.lease_grace_until = clock.t + 0.5
    clock.t += 1.0  # past the grace, within k0's own lease
    assert d.remove("k0") == ErrorCode.OBJECT_HAS_LEASE
    assert d.remove("k1") == 0
    assert all(s.state == SegState.ACTIVE for s in d.segments.values())
