"""Tenants sharing one pool, end to end (docs/tenants.md).

A real master and real node daemons (processes); clients of several tenants
in this process. The same key in two tenants is two objects, each read back
byte for byte by its own tenant; removals in one tenant leave every other
tenant's objects exactly as they were; the Mooncake class with ``tenant_id``
acts for its tenant (the connector's ``"tenant"``: tests/connector/test_tenant.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.tenants import TENANT_SEP, scope_prefix
from kvpool.store import Client
from kvpool.store.config import ReplicateConfig
from kvpool.store.errors import ObjectNotFound, QuotaExceeded, StoreError
from kvpool.store.mooncake import MooncakeDistributedStore
from support.factories import client_factory

QUOTAS = "tenants:\n  flood: {memory: 2MiB}\n  q: {memory: 1MiB}\n"


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    d = tmp_path_factory.mktemp("tenants")
    (d / "master.yaml").write_text(QUOTAS)
    with MasterProcess(data_dir=str(d / "data"), lease_ttl_ms=1000, client_ttl_s=3,
                       extra_args=["--config", str(d / "master.yaml")]) as m:
        yield m


@pytest.fixture(scope="module")
def daemons(master: MasterProcess) -> Iterator[list[NodeDaemonProcess]]:
    # one daemon acts for a tenant of its own: what it contributes is the pool's
    ds = [NodeDaemonProcess(master.address, "24MiB"),
          NodeDaemonProcess(master.address, "24MiB", extra_args=["--tenant", "ops"])]
    try:
        for d in ds:
            d.start()
        yield ds
    finally:
        for d in ds:
            d.__exit__()


@pytest.fixture
def make_client(master: MasterProcess,
                daemons: list[NodeDaemonProcess]) -> Iterator[Callable[..., Client]]:
    with client_factory(master.address, rpc_timeout_s=5.0, guard=False) as make:
        yield make


def values(seed: int, sizes: list[int]) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


SIZES = [100, 4096, 64, 64, 300_000]  # single puts (spares too), a batch, a large value
KEYS = ["k0", "k1", "k2", "k3", "big"]


def fill(c: Client, seed: int, keys: list[str] = KEYS) -> dict[str, bytes]:
    vals = dict(zip(keys, values(seed, SIZES), strict=True))
    c.put(keys[0], vals[keys[0]])
    c.put(keys[1], vals[keys[1]])
    assert c.put_batch(keys[2:4], [vals[k] for k in keys[2:4]]) == [ErrorCode.OK] * 2
    c.put(keys[4], vals[keys[4]])
    return vals


def assert_holds(c: Client, vals: dict[str, bytes]) -> None:
    """``c`` reads back exactly ``vals`` by every read form."""
    keys = list(vals)
    for k, v in vals.items():
        assert c.get(k) == v
        assert c.get_size(k) == len(v)
    assert c.get_batch(keys) == [vals[k] for k in keys]
    bufs = [bytearray(len(vals[k])) for k in keys]
    assert c.batch_get_into(keys, bufs) == [len(vals[k]) for k in keys]
    assert [bytes(b) for b in bufs] == [vals[k] for k in keys]
    assert c.batch_exists(keys) == [True] * len(keys)


def test_daemon_acts_for_its_tenant(daemons: list[NodeDaemonProcess]) -> None:
    assert [d.info["tenant"] for d in daemons] == ["default", "ops"]


def test_same_key_in_two_tenants_is_two_objects(make_client: Callable[..., Client]) -> None:
    a, b, d = (make_client(tenant=t) for t in ("team-a", "team-b", "default"))
    va = fill(a, 1)
    assert b.batch_exists(KEYS) == [False] * len(KEYS)  # a's keys are not b's
    with pytest.raises(ObjectNotFound):
        b.get("k0")
    vb = fill(b, 2)
    assert va != vb
    assert_holds(a, va)
    assert_holds(b, vb)
    assert d.batch_exists(KEYS) == [False] * len(KEYS)
    # a removal names the caller's object only
    a.remove("k0", force=True)
    assert not a.exists("k0") and b.get("k0") == vb["k0"]
    assert b.batch_remove(["k1", "nope"], force=True) == [ErrorCode.OK,
                                                          ErrorCode.OBJECT_NOT_FOUND]
    assert a.get("k1") == va["k1"]
    assert a.remove_all(force=True) == len(KEYS) - 1
    assert b.remove_all(force=True) == len(KEYS) - 1


def test_three_tenants_removals_leave_the_others_byte_for_byte(
        make_client: Callable[..., Client]) -> None:
    cs = {t: make_client(tenant=t) for t in ("t1", "t2", "t3", "default")}
    held = {t: fill(c, 10 + i) for i, (t, c) in enumerate(cs.items())}
    # each tenant's keys once more under a name only it has
    for t, c in cs.items():
        c.put(f"only-{t}", t.encode() * 10)
        held[t][f"only-{t}"] = t.encode() * 10
    for t, c in cs.items():
        others = [f"only-{o}" for o in cs if o != t]
        assert c.batch_exists(others) == [False] * 3
    assert cs["t2"].remove_by_regex("^k", force=True) == 4  # k0..k3 of t2 only
    held["t2"] = {k: v for k, v in held["t2"].items() if not k.startswith("k")}
    assert cs["t1"].remove_all(force=True) == len(KEYS) + 1
    held["t1"] = {}
    assert cs["t1"].batch_exists(KEYS) == [False] * len(KEYS)
    for t in ("t2", "t3", "default"):
        assert_holds(cs[t], held[t])
    for t in ("t2", "t3", "default"):
        assert cs[t].remove_all(force=True) == len(held[t])


def test_keys_cannot_spell_another_tenants_namespace(
        make_client: Callable[..., Client]) -> None:
    a, d = make_client(tenant="team-a"), make_client()
    a.put("secret", b"a's bytes")
    stored = scope_prefix("team-a") + "secret"
    assert stored == f"{TENANT_SEP}team-a{TENANT_SEP}secret"
    for c in (a, d):  # neither the default tenant nor any other can name it
        with pytest.raises(StoreError) as ei:
            c.batch_exists([stored])
        assert ei.value.code == ErrorCode.INVALID_KEY
        assert c.batch_remove([stored], force=True) == [ErrorCode.INVALID_KEY]
        assert c.get_batch([stored]) == [None]
    assert a.get("secret") == b"a's bytes"
    a.remove_all(force=True)


def mooncake(master: MasterProcess, tenant: str | None) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore()
    kw = {} if tenant is None else {"tenant_id": tenant}
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address,
                   **kw) == 0
    return s


def test_mooncake_tenant_id(master: MasterProcess, make_client: Callable[..., Client]) -> None:
    stores = {t: mooncake(master, t) for t in ("team-a", "team-b")}
    plain = mooncake(master, None)
    try:
        a, b = stores["team-a"], stores["team-b"]
        assert a.put("shared", b"from a") == 0 and b.put("shared", b"from b") == 0
        assert (a.get("shared"), b.get("shared"), plain.get("shared")) == (
            b"from a", b"from b", b"")
        assert (a.is_exist("shared"), plain.is_exist("shared")) == (1, 0)
        assert a.put("\x1fteam-b\x1fshared", b"x") == -600  # no escaping the namespace
        # what a native client of the tenant stored, the Mooncake store of that tenant reads
        # (and the stored form "\x1fteam-a\x1fk" is what this class wrote before tenants
        # moved to the master: its old keys are the same objects)
        native = make_client(tenant="team-a")
        native.put("native", b"n" * 1000)
        assert a.get("native") == b"n" * 1000 and b.is_exist("native") == 0
        assert native.get("shared") == b"from a"
        assert plain.put("shared", b"default") == 0
        assert a.remove_all(True) == 2  # shared + native: team-a's only
        assert (b.get("shared"), plain.get("shared")) == (b"from b", b"default")
        assert b.remove_by_regex("^sh", True) == 1 and plain.get("shared") == b"default"
        assert plain.remove_all(True) == 1
    finally:
        for s in (*stores.values(), plain):
            s.close()



def test_a_flood_evicts_its_own_and_a_full_quota_refuses(
        master: MasterProcess, make_client: Callable[..., Client]) -> None:
    calm = make_client(tenant="calm")
    # (without spare allocations: see test_spares_are_charged_to_the_quota)
    flood = make_client(tenant="flood", reserve_single_puts=False)
    held = fill(calm, 7)
    # 40 x 256 KiB through flood's 2 MiB quota: its own oldest objects make room
    big = 256 << 10
    for i in range(40):
        flood.put(f"f{i}", bytes([i]) * big)
    kept = flood.batch_exists([f"f{i}" for i in range(40)])
    assert kept[-1] and sum(kept) <= 8
    assert flood.get("f39") == bytes([39]) * big
    assert_holds(calm, held)  # byte for byte, none evicted for flood
    # q's 1 MiB held by hard-pinned objects: nothing of its own may go
    q = make_client(tenant="q")
    pin = ReplicateConfig(with_hard_pin=True)
    q.put("p0", b"a" * (400 << 10), pin)
    q.put("p1", b"b" * (400 << 10), pin)
    with pytest.raises(QuotaExceeded, match="put 'p2': tenant 'q' is at its quota") as ei:
        q.put("p2", b"c" * (400 << 10))
    assert ei.value.code == ErrorCode.QUOTA_EXCEEDED
    assert q.put_batch(["p3", "p4"], [b"d" * (300 << 10)] * 2) == \
        [ErrorCode.QUOTA_EXCEEDED] * 2
    assert q.batch_exists(["p0", "p1", "p2", "p3", "p4"]) == [True, True, False, False, False]
    mc = mooncake(master, "q")  # Mooncake's code for an allocation it cannot make
    try:
        assert mc.put("p5", b"e" * (400 << 10)) == -200 and mc.is_exist("p5") == 0
        assert mc.get("p0") == b"a" * (400 << 10)
    finally:
        mc.close()
    assert_holds(calm, held)
    for c in (calm, flood, q):
        c.remove_all(force=True)


def test_spares_are_charged_to_the_quota(make_client: Callable[..., Client]) -> None:
    """A client's default puts (small values: through spare allocations) stay
    within the tenant's quota as PUT_START's do: the commit naming a spare
    evicts the tenant's own LRU objects, or is refused (QuotaExceeded, the
    value not stored, the spare released) when none can go."""
    flood = make_client(tenant="flood")
    try:
        for i in range(12):  # the first through PUT_START, the others through spares
            flood.put(f"s{i}", bytes([i]) * (256 << 10))
        # batches: the first through BATCH_PUT_START, the second through its spares
        assert flood.put_batch(["b0", "b1"], [b"x" * (256 << 10)] * 2) == [ErrorCode.OK] * 2
        assert flood.put_batch(["b2", "b3"], [b"y" * (256 << 10)] * 2) == [ErrorCode.OK] * 2
        kept = flood.batch_exists([f"s{i}" for i in range(12)] + [f"b{i}" for i in range(4)])
        assert kept[-4:] == [True] * 4 and sum(kept) <= 8
        assert flood.get("b3") == b"y" * (256 << 10)
    finally:
        flood.remove_all(force=True)
    q = make_client(tenant="q")  # 1 MiB
    pin = ReplicateConfig(with_hard_pin=True)
    small = 100 << 10
    try:
        q.put("p0", b"a" * (500 << 10), pin)
        q.put("s0", b"s" * small)  # its commit leaves q a spare of this size
        assert q._parts.writes.spares.by_size.get(small)
        q.remove("s0")
        q.put("p1", b"b" * (500 << 10), pin)  # 1000 KiB pinned: nothing may go
        with pytest.raises(QuotaExceeded, match="put 's1': tenant 'q' is at its quota"):
            q.put("s1", b"t" * small)  # through the spare
        assert not q._parts.writes.spares.by_size.get(small)  # released, not kept
        assert q.batch_exists(["p0", "p1", "s1"]) == [True, True, False]
        q.remove("p1", force=True)
        q.put("s1", b"t" * small)
        assert q.get("s1") == b"t" * small and q.get("p0") == b"a" * (500 << 10)
    finally:
        q.remove_all(force=True)
