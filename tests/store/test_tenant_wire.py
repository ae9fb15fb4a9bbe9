"""What a client of a tenant sends: every request that names, lists, counts or
removes objects carries the client's tenant (docs/tenants.md), and a client of
the default tenant sends ``""`` (one byte; what a client from before tenants
means by sending nothing there).

A real master (in this process, so its decoded requests can be read at the
handlers) serves a real client that contributes its own memory; every call of
the client's API that reaches the master is made once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvpool.core.codec import OPS, decode_request
from kvpool.core.config import ConfigError
from kvpool.core.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.server import MasterServer
from kvpool.store import Client, ClientConfig
from kvpool.store.errors import QuotaExceeded, StoreError, error_for_code

SCOPED = {spec.op.name for spec in OPS.values()
          if "tenant" in spec.request.__struct_fields__}
# the scoped ops the client's API below sends (UPSERT/LIST_OBJECTS/BATCH_GET_SIZE:
# no Client call sends them)
EXPECTED = {"PUT_START", "PUT_END", "PUT_COMMIT", "BATCH_PUT_START", "BATCH_PUT_END",
            "BATCH_PUT_COMMIT", "BATCH_PUT_REVOKE", "GET_REPLICA_LIST",
            "BATCH_GET_REPLICA_LIST", "EXIST", "BATCH_EXIST", "GET_SIZE", "REMOVE",
            "BATCH_REMOVE", "REMOVE_ALL", "REMOVE_BY_REGEX", "BATCH_REPLICA_CLEAR", "STATS",
            "CREATE_COPY_TASK", "CREATE_MOVE_TASK", "QUERY_TASK", "BATCH_UPSERT_START"}


class Tap:
    """The payloads a real master's handlers receive (decoded as they decode them)."""

    def __init__(self, server: MasterServer) -> None:
        self.seen: list[tuple[Any, list[Any]]] = []  # (request, its raw args array)
        self._inner = server._payload
        server._payload = self

    def __call__(self, payload: bytes) -> bytes:
        _, _, req = decode_request(payload, 1 << 30)
        self.seen.append((req, msgpack.unpackb(payload, raw=True)[2]))
        return self._inner(payload)

    def scoped(self) -> list[tuple[Any, list[Any]]]:
        return [(r, raw) for r, raw in self.seen if r.OP.name in SCOPED]


@pytest.fixture
def served() -> Iterator[tuple[MasterServer, Tap]]:
    server = MasterServer(MasterConfig(port=0, local_socket="off", rpc_tcp=False))
    tap = Tap(server)
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    try:
        yield server, tap
    finally:
        server.stop()
        loop.join(5)
        server.close()


def exercise(c: Client) -> None:
    """Every Client call that sends a scoped request, once."""
    c.put("a", b"x" * 100)
    c.put("b", b"y" * 100)  # the spare the first put asked for: PUT_COMMIT
    c.put_batch(["c", "d"], [b"1" * 64, b"2" * 64])
    c.put_batch(["e", "f"], [b"3" * 64, b"4" * 64])  # BATCH_PUT_COMMIT
    c.batch_put_from(["c", "g"], [b"5" * 64, b"6" * 64], upsert=True)
    assert c.get("a") == b"x" * 100 and c.get_batch(["c", "g"]) == [b"5" * 64, b"6" * 64]
    assert c.exists("a") and c.batch_exists(["a", "zz"]) == [True, False]
    assert c.get_size("b") == 100
    res = c.batch_put_reserve(["r1", "r2"], [10, 10])
    assert len(res) == 2
    c.batch_put_abort(["r1", "r2"])
    seg = c.segment_ids[0]
    tid = c.create_copy_task("a", [seg])
    c.query_task(tid)
    try:
        c.create_move_task("b", seg, seg)
    except Exception:  # same source and target: refused, but it was sent
        pass
    c.batch_replica_clear(["zz"], seg)
    c.stats()
    c.remove("a", force=True)
    c.batch_remove(["c", "d"], force=True)
    c.remove_by_regex("^e", force=True)
    c.remove_all(force=True)


@pytest.mark.parametrize("tenant", ["team-a", "default"])
def test_every_scoped_request_carries_the_tenant(served: tuple[MasterServer, Tap],
                                                 tenant: str) -> None:
    server, tap = served
    with Client(ClientConfig(master_address=f"127.0.0.1:{server.port}", memory_size=4 << 20,
                             tenant=tenant, guard=False)) as c:
        assert c.tenant == tenant
        exercise(c)
    scoped = tap.scoped()
    assert EXPECTED <= {r.OP.name for r, _ in scoped}  # spares given back at close too
    if tenant == "default":
        for req, raw in scoped:
            assert req.tenant == "" and raw[-1] == b"", req
    else:
        bad = [r for r, _ in scoped if r.tenant != tenant]
        assert not bad, bad[:3]
        assert all(raw[-1] == tenant.encode() for _, raw in scoped)


def test_bad_tenant_names_are_refused_at_construction() -> None:
    for bad in ("a b", "-x", "x" * 65, "\x1fa", "é"):
        with pytest.raises(ConfigError, match="tenant") as ei:
            ClientConfig(tenant=bad)
        assert ei.value.code == ErrorCode.CONFIG_ERROR
    assert ClientConfig(tenant="").tenant == "default"
    assert ClientConfig(tenant="Team_1.a-b").tenant == "Team_1.a-b"


def test_quota_exceeded_is_its_own_error() -> None:
    exc = error_for_code(ErrorCode.QUOTA_EXCEEDED, "put 'k': tenant a at its memory quota")
    assert isinstance(exc, QuotaExceeded) and exc.code == ErrorCode.QUOTA_EXCEEDED
    assert "quota" in str(exc)


def test_mooncake_tenant_id_is_the_clients_tenant(served: tuple[MasterServer, Tap]) -> None:
    """``tenant_id`` (positional and the config dict's) sets the client's
    tenant: keys go to the master as the caller wrote them, with the tenant
    beside them (the master scopes them; no client-side prefix)."""
    from kvpool.store.mooncake import MooncakeDistributedStore

    server, tap = served
    addr = f"127.0.0.1:{server.port}"
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert a.setup("localhost", "P2PHANDSHAKE", 4 << 20, 16 << 20, "tcp", "", addr,
                   tenant_id="team-a") == 0
    try:
        assert b.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": 4 << 20, "master_server_addr": addr,
                        "tenant_id": "team-b", "guard": False}) == 0
        try:
            assert a._client.tenant == "team-a" and b._client.tenant == "team-b"
            assert a.put("k", b"from a") == 0 and a.get("k") == b"from a"
            assert b.is_exist("k") == 0  # the master scopes it: b has no "k"
            assert a.put("\x1fteam-b\x1fk", b"x") == -600  # no spelling of another's key
            assert a.remove_by_regex("^k$", True) >= 0 and a.remove_all(True) >= 0
        finally:
            b.close()
    finally:
        a.close()
    mine = [r for r, _ in tap.scoped() if r.tenant == "team-a"]
    assert {r.OP.name for r in mine} >= {"PUT_START", "GET_REPLICA_LIST", "REMOVE_BY_REGEX",
                                         "REMOVE_ALL"}
    assert [r.key for r in mine if r.OP.name == "PUT_START"] == ["k"]
    rx = next(r for r in mine if r.OP.name == "REMOVE_BY_REGEX")
    assert (rx.pattern, rx.prefix, rx.exclude_prefix) == ("^k$", "", "")
    assert any(r.tenant == "team-b" and r.OP.name == "EXIST" for r, _ in tap.scoped())
    # a bad tenant_id is refused by setup with INVALID_PARAMS, no client left behind
    c = MooncakeDistributedStore()
    assert c.setup("localhost", "P2PHANDSHAKE", 4 << 20, 16 << 20, "tcp", "", addr,
                   tenant_id="no/slash") == -600 and c._client is None


def test_a_tenant_the_key_may_not_act_as_is_refused_at_setup(tmp_path: Path) -> None:
    """With ``tenant_keys`` (CURVE), a client naming a tenant its key is not
    listed for fails setup with PERMISSION_DENIED (not at its first put)."""
    from kvpool.cluster.processes import MasterProcess
    from kvpool.core.auth import CurveConfig, save_keypair

    pub, sec = save_keypair(tmp_path / "keys", "cluster")
    (tmp_path / "master.yaml").write_text(f"tenant_keys:\n  a: [{pub}]\n")
    curve = CurveConfig(enabled=True, secret_key_file=str(sec))
    with MasterProcess(curve_key=str(sec),
                       extra_args=["--config", str(tmp_path / "master.yaml")]) as m:
        for tenant in ("a", "default"):
            with Client(ClientConfig(master_address=m.address, tenant=tenant, curve=curve)) as c:
                assert c.exists("k") is False
        c = Client(ClientConfig(master_address=m.address, tenant="b", curve=curve))
        with pytest.raises(StoreError, match="tenant 'b'") as ei:
            c.setup()
        assert ei.value.code == ErrorCode.PERMISSION_DENIED
        c.close()
