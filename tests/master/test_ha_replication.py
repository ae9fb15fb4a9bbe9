"""Journal replication between a leader's directory and standbys, over real
sockets on loopback, each test over both transports (the plain socket served
on the loop, and ZeroMQ): live batches, acks and the in-sync set,
snapshots interleaved with live changes, tails after a leader change,
divergent standbys, stale epochs, promotion."""

from __future__ import annotations

import random
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import SegmentDescriptor, SegmentKind
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.durability import Durability
from kvpool.master.ha.replication import ReplicationLog
from kvpool.master.ha.sink import ReplicaSink, SinkState, promote_directory
from kvpool.master.ha.source import ReplicationSource
from kvpool.master.ha.transport import SOCKET_SCHEME

CFG = MasterConfig(data_dir=None, capabilities=False)
#: where a test's leaders bind (set per test by ``ctx``: one transport or the other)
BIND = f"{SOCKET_SCHEME}127.0.0.1:0"


@pytest.fixture(params=["socket", "zmq"])
def ctx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[zmq.Context]:
    """The ZeroMQ context of the test; its leaders bind the transport of the param."""
    monkeypatch.setattr(sys.modules[__name__], "BIND", f"{SOCKET_SCHEME}127.0.0.1:0"
                        if request.param == "socket" else "tcp://127.0.0.1:0")
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # closes any socket a failed test left open


class Leader:
    """A directory driven like the master's loop: ops, then publish the records."""

    def __init__(self, ctx: zmq.Context, epoch: int, d: Directory | None = None,
                 src_log: Any = None, lazy_send_s: float = 0.0) -> None:
        self.d = d or Directory(CFG)
        self.src = ReplicationSource(self.d, BIND, epoch, src_log, ctx,
                                     lazy_send_s=lazy_send_s)
        self.rng = random.Random(epoch)
        self.n = 0

    def commit(self) -> int:
        recs = list(self.d.records)
        self.d.records.clear()
        return self.src.publish(recs)

    def mount(self, sid: str, size: int = 64 << 20) -> None:
        desc = SegmentDescriptor(sid, f"client-{sid}", "host", SegmentKind.MEMORY, size,
                                 f"shm-{sid}")
        self.d.mount(f"client-{sid}", desc)
        self.commit()

    def put(self, n: int, size: int = 4096) -> list[str]:
        keys = []
        for _ in range(n):
            key = f"k{self.n:06d}"
            self.n += 1
            code, _p = self.d.put_start("writer", key, size)
            assert code == 0
            assert self.d.put_end("writer", key) == 0
            keys.append(key)
        self.commit()
        return keys

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            assert self.d.remove(k, force=True) == 0
        self.commit()


def state(d: Directory) -> tuple[Any, ...]:
    segs = sorted((s.id, s.alloc.used) for s in d.segments.values())
    objs = {k: d.replay.snapshot_record(k) for k in d.objects}
    return segs, objs


def pump(leader: Leader, sinks: list[ReplicaSink], until: Callable[[], bool],
         timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader.src.poll()
        for s in sinks:
            s.poll(0.002)
        if until():
            return
    raise AssertionError("replication did not converge in time")


def sink_for(ctx: zmq.Context, name: str) -> ReplicaSink:
    return ReplicaSink(Directory(CFG), name, context=ctx)


def join(leader: Leader, sink: ReplicaSink, epoch: int) -> None:
    """``sink`` (named "s1") follows ``leader`` in ``epoch``, a segment is
    mounted, and the leader sees the standby caught up."""
    sink.connect(leader.src.endpoint, epoch)
    leader.mount("seg-a")
    pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])


def test_live_stream_acks_and_in_sync_set(ctx: zmq.Context) -> None:
    leader = Leader(ctx, epoch=7)
    sink = sink_for(ctx, "s1")
    try:
        sink.connect(leader.src.endpoint, 7)
        pump(leader, [sink], lambda: "s1" in leader.src.standbys
             and sink.state is SinkState.STREAMING)
        leader.mount("seg-a")
        leader.mount("seg-b")
        keys = leader.put(300)
        leader.remove(keys[::7])
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        assert state(sink.directory) == state(leader.d)
        leader.src.add_sync("s1")
        last = leader.put(50)[-1] and leader.src.last_lsn
        assert leader.src.acked_lsn() < last  # not yet acknowledged by s1
        pump(leader, [sink], lambda: leader.src.acked_lsn() == last)
        assert state(sink.directory) == state(leader.d)
        assert sink.log.last_lsn == last and sink.stats.snapshots == 0
    finally:
        sink.close()
        leader.src.close()


def test_in_sync_member_that_stops_acking_holds_replies_then_is_lagging(
        ctx: zmq.Context) -> None:
    leader = Leader(ctx, epoch=3)
    sink = sink_for(ctx, "s1")
    try:
        join(leader, sink, 3)
        leader.src.add_sync("s1")
        leader.put(10)
        last = leader.src.last_lsn
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.3:  # the standby is silent (not polling)
            leader.src.poll()
            time.sleep(0.01)
        assert leader.src.acked_lsn() < last
        assert leader.src.lagging(0.2) == ["s1"]
        pump(leader, [sink], lambda: leader.src.acked_lsn() == last)
        assert leader.src.lagging(0.2) == []
        # removed from the set (after etcd said so): the leader alone suffices
        leader.src.remove_sync("s1")
        sink.close()
        leader.put(5)
        assert leader.src.acked_lsn() == leader.src.last_lsn
    finally:
        sink.close()
        leader.src.close()


def test_idle_in_sync_member_is_not_lagging_when_a_change_follows(ctx: zmq.Context) -> None:
    """An in-sync standby that acked everything, then saw no change for longer
    than the timeout, owes the next batch only from the moment it is sent:
    it must not be dropped from the in-sync set before it could answer."""
    leader = Leader(ctx, epoch=4)
    sink = sink_for(ctx, "s1")
    try:
        join(leader, sink, 4)
        leader.src.add_sync("s1")
        time.sleep(0.3)  # idle: nothing to ack
        assert leader.src.lagging(0.2) == []
        leader.put(3)
        assert leader.src.acked_lsn() < leader.src.last_lsn  # owed, just sent
        assert leader.src.lagging(0.2) == []
        time.sleep(0.3)  # now silent past the timeout while owing: lagging
        assert leader.src.lagging(0.2) == ["s1"]
        pump(leader, [sink], lambda: leader.src.acked_lsn() == leader.src.last_lsn)
        assert leader.src.lagging(0.2) == []
    finally:
        sink.close()
        leader.src.close()


def test_late_standby_gets_a_snapshot_interleaved_with_live_changes(ctx: zmq.Context) -> None:
    leader = Leader(ctx, epoch=5)
    leader.src.snapshot_slice_s = 0.0005  # many slices: live batches fall between them
    leader.src.log.ring_limit = 1000  # the ring no longer holds the start: a snapshot
    sink = sink_for(ctx, "late")
    try:
        # a tenant quota set live: long out of the ring, it comes with the snapshot
        leader.d.set_tenant_quota("q", 1 << 20, -1, 4096)
        leader.commit()
        leader.mount("seg-a", 256 << 20)
        leader.mount("seg-b", 256 << 20)
        keys = leader.put(4000, size=1024)
        sink.connect(leader.src.endpoint, 5)
        rounds = 0
        while sink.state is not SinkState.STREAMING or rounds < 5:
            leader.src.poll()
            sink.poll(0.001)
            # the leader keeps changing state while the snapshot streams
            keys += leader.put(20, size=1024)
            leader.remove([keys.pop(leader.rng.randrange(len(keys))) for _ in range(10)])
            rounds += 1
            assert rounds < 5000
        assert rounds > 5
        pump(leader, [sink], lambda: leader.src.caught_up() == ["late"])
        assert sink.stats.snapshots == 1
        assert state(sink.directory) == state(leader.d)
        assert len(sink.directory.objects) == len(leader.d.objects) == len(keys)
        assert sink.directory.tenants.live == {"q": (1 << 20, -1, 4096)}
    finally:
        sink.close()
        leader.src.close()


def test_snapshot_interrupted_by_a_reconnect_starts_over(ctx: zmq.Context) -> None:
    """A standby that reconnects (silent stream, new leader) in the middle of a
    snapshot holds a partial directory: it must not claim the snapshot's
    position (and be given only the tail after it)."""
    leader = Leader(ctx, epoch=6, src_log=ReplicationLog(ring_records=50))
    sink = sink_for(ctx, "s1")
    try:
        leader.mount("seg-a", 256 << 20)
        leader.put(20000, size=1024)
        sink.connect(leader.src.endpoint, 6)
        deadline = time.monotonic() + 10
        while not (sink.state is SinkState.SNAPSHOT and 0 < len(sink.directory.objects) < 20000):
            assert time.monotonic() < deadline, (sink.state, len(sink.directory.objects))
            leader.src.poll()  # one slice of the snapshot per call
            sink.poll(0.01)
        sink.connect(leader.src.endpoint, 6)  # mid-snapshot
        leader.put(5)
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        assert state(sink.directory) == state(leader.d)
    finally:
        sink.close()
        leader.src.close()


def test_standby_refuses_an_older_epoch(ctx: zmq.Context) -> None:
    old = Leader(ctx, epoch=10)
    sink = sink_for(ctx, "s1")
    try:
        join(old, sink, 10)
        old.src.add_sync("s1")
        sink.observe_epoch(12)  # etcd told the standby of a newer term
        old.put(3)
        pump(old, [sink], lambda: sink.state is SinkState.REFUSED and "s1" not in old.src.standbys)
        assert old.src.acked_lsn() < old.src.last_lsn  # no ack can be collected
        assert len(sink.directory.objects) == 0
        # and a hello from a standby that knows a newer term is refused by the old leader
        sink2 = sink_for(ctx, "s2")
        sink2.observe_epoch(11)
        sink2.connect(old.src.endpoint, 10)
        pump(old, [sink2], lambda: sink2.state is SinkState.REFUSED)
        assert "older" in sink2.refusal
        sink2.close()
    finally:
        sink.close()
        old.src.close()


def test_leader_change_tail_for_a_prefix_snapshot_for_a_divergent_standby(
        ctx: zmq.Context) -> None:
    """s1 (in sync) is promoted; s2 holds a batch s1 never got (unacknowledged,
    so never replied): it must be resynced by snapshot, not kept; s3, behind
    but on the history, gets the tail."""
    l1 = Leader(ctx, epoch=10)
    s1, s2, s3 = (sink_for(ctx, n) for n in ("s1", "s2", "s3"))
    try:
        for s in (s1, s2, s3):
            s.connect(l1.src.endpoint, 10)
        l1.mount("seg-a")
        keys = l1.put(100)
        pump(l1, [s1, s2, s3], lambda: sorted(l1.src.caught_up()) == ["s1", "s2", "s3"])
        s3.close()  # s3 stops here
        l1.put(50)
        pump(l1, [s1, s2], lambda: sorted(l1.src.caught_up()) == ["s1", "s2"])
        s1.close()  # s1 stops; s2 gets one more batch that nobody else has
        l1.remove(keys[:20])
        l1.put(30)
        pump(l1, [s2], lambda: l1.src.caught_up() == ["s2"])
        assert s2.log.last_lsn > s1.log.last_lsn
        l1.src.close()  # the old leader dies

        d = s1.directory
        promote_directory(d)
        l2 = Leader(ctx, epoch=20, d=d, src_log=s1.log)
        l2.n = 100_000  # new keys
        expected_keys = set(d.objects)
        l2.put(10)
        for s in (s2, s3):
            s.observe_epoch(20)
            s.connect(l2.src.endpoint, 20)
        pump(l2, [s2, s3], lambda: sorted(l2.src.caught_up()) == ["s2", "s3"])
        assert s2.stats.snapshots == 1  # divergent: resynced
        assert s3.stats.snapshots == 0  # a prefix: the tail was enough
        for s in (s2, s3):
            assert state(s.directory) == state(l2.d)
        assert expected_keys <= set(s2.directory.objects)
        assert all(k in s2.directory.objects for k in keys[:20])  # the unacked remove is gone
        assert l2.src.log.history[-1][0] == 20 and s3.log.history == l2.src.log.history
    finally:
        for s in (s1, s2, s3):
            s.close()


def test_promoted_standby_serves_every_object_and_places_new_ones(ctx: zmq.Context) -> None:
    leader = Leader(ctx, epoch=2)
    sink = sink_for(ctx, "s1")
    try:
        sink.connect(leader.src.endpoint, 2)
        leader.mount("seg-a")
        leader.mount("seg-b")
        keys = leader.put(200)
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        d = sink.directory
        assert promote_directory(d) == 2
        for k in keys:
            code, val = d.get_replicas(k)
            assert code == 0, (k, ErrorCode(code))
            obj, _reps = val
            assert obj.size == 4096
        code, p = d.put_start("writer", "new-key", 4096)
        assert code == 0 and p is not None
        assert d.put_end("writer", "new-key") == 0
        assert d.records  # journaled as a leader's directory
        # no placement overlaps a replicated object
        used = {(r.id, off) for k in d.objects for r, off in zip(d.objects[k].replicas[::2],
                                                                 d.objects[k].replicas[1::2],
                                                                 strict=True)}
        assert len(used) == len(d.objects)
    finally:
        sink.close()
        leader.src.close()


def _restart(cfg: MasterConfig) -> tuple[Durability, Directory]:
    store = Durability(cfg)
    return store, store.restore(lambda: Directory(cfg))


def test_standby_journal_restores_the_replicated_state_and_its_position(
        ctx: zmq.Context, tmp_path: Path) -> None:
    """A standby with a data dir: the snapshot it joins with is written whole,
    the live batches after it are journaled with their position, a periodic
    (fuzzy) snapshot covers them; a restart restores the same state and
    position, and the restarted standby rejoins with a tail, not a snapshot."""
    cfg = MasterConfig(data_dir=str(tmp_path), capabilities=False)
    # a small ring: the late standby cannot get a tail from position 0
    leader = Leader(ctx, epoch=5, src_log=ReplicationLog(ring_records=50))
    store, restored = _restart(cfg)
    assert store.position is None and not restored.objects
    sink = ReplicaSink(Directory(CFG), "s1", store=store, context=ctx)
    sink2: ReplicaSink | None = None
    try:
        leader.mount("seg-a")
        keys = leader.put(300)
        sink.connect(leader.src.endpoint, 5)
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        assert sink.stats.snapshots == 1 and sink.based
        keys += leader.put(40)
        leader.remove(keys[:25])
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        store.request_snapshot()
        store.tick(sink.directory, time.monotonic(), sink.position())
        leader.put(7)  # journaled while the fuzzy snapshot is written
        while store.busy:
            pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
            store.tick(sink.directory, time.monotonic(), sink.position())
        leader.remove(keys[30:35])
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        expected, pos = state(leader.d), sink.position()
        assert state(sink.directory) == expected
        sink.close()
        store.close([])  # a kill -9 loses nothing more: every batch was written

        store, restored = _restart(cfg)
        assert store.position == pos, (store.position, pos)
        assert state(restored) == expected
        log_ = ReplicationLog()
        log_.reset(pos.epoch, pos.lsn, pos.history)
        sink2 = ReplicaSink(restored, "s1", store=store, log_=log_, context=ctx, based=True)
        leader.put(5)
        sink2.connect(leader.src.endpoint, 5)
        pump(leader, [sink2], lambda: leader.src.caught_up() == ["s1"])
        assert sink2.stats.snapshots == 0  # the tail after its journaled position
        assert state(sink2.directory) == state(leader.d)
        sink2.close()
        store.close([])
        store, restored = _restart(cfg)
        assert state(restored) == state(leader.d)
        assert store.position is not None and store.position.lsn == leader.src.last_lsn
        # anything journaled after the last position (a leader's records) voids it
        assert store.journal is not None
        store.commit([[4, keys[40]]])
        store.close([])
        store, restored = _restart(cfg)
        assert store.position is None and keys[40] not in restored.objects
        store.close([])
    finally:
        sink.close()
        if sink2 is not None:
            sink2.close()
        leader.src.close()



def test_pipelined_batches_are_written_and_acked_together_in_order(
        ctx: zmq.Context, tmp_path: Path) -> None:
    """The leader sends batch after batch without waiting for acks; a standby
    that finds several waiting writes them in one write, acks them with one
    cumulative ACK (never past what it holds), and applies them in order."""
    cfg = MasterConfig(data_dir=str(tmp_path), capabilities=False)
    leader = Leader(ctx, epoch=9)
    store, _restored = _restart(cfg)
    sink = ReplicaSink(Directory(CFG), "s1", store=store, context=ctx)
    try:
        sink.connect(leader.src.endpoint, 9)
        leader.mount("seg-a")
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"] and sink.based)
        leader.src.add_sync("s1")
        base = leader.src.acked_lsn()
        assert base == leader.src.last_lsn
        assert store.journal is not None
        written = store.journal.records_written
        lasts = []
        keys: list[str] = []
        for _ in range(5):  # in flight together: the standby does not poll meanwhile
            keys += leader.put(20)
            lasts.append(leader.src.last_lsn)
        keys_removed = keys[:7]
        leader.remove(keys_removed)  # a later batch undoes part of an earlier one
        lasts.append(leader.src.last_lsn)
        assert leader.src.acked_lsn() == base  # nothing acknowledged yet
        time.sleep(0.05)  # every batch has arrived
        assert sink.poll(1.0) == 6
        assert sink.log.last_lsn == lasts[-1]
        assert store.journal.records_written == written + 100 + 7 + 1  # one write, + position
        deadline = time.monotonic() + 5
        acks = 0
        while leader.src.acked_lsn() < lasts[-1]:
            assert time.monotonic() < deadline
            leader.src.wait(50)
            acks += leader.src.poll()
        assert acks == 1  # one cumulative ack for the six batches
        assert state(sink.directory) == state(leader.d)
        assert not any(k in sink.directory.objects for k in keys_removed)
    finally:
        sink.close()
        store.close([])
        leader.src.close()


def test_standby_killed_with_batches_in_flight_holds_only_what_it_acked(
        ctx: zmq.Context, tmp_path: Path) -> None:
    """Batches in flight when an in-sync standby dies are never acknowledged
    (their replies stay held); restarted from its data dir, the standby holds
    exactly what it acked and rejoins with the tail of the rest."""
    cfg = MasterConfig(data_dir=str(tmp_path), capabilities=False)
    leader = Leader(ctx, epoch=4)
    store, _restored = _restart(cfg)
    sink = ReplicaSink(Directory(CFG), "s1", store=store, context=ctx)
    sink2: ReplicaSink | None = None
    try:
        sink.connect(leader.src.endpoint, 4)
        leader.mount("seg-a")
        leader.put(50)
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"] and sink.based)
        leader.src.add_sync("s1")
        acked_state, acked_lsn = state(leader.d), leader.src.last_lsn
        assert leader.src.acked_lsn() == acked_lsn
        leader.put(30)  # in flight: sent, never taken by the standby
        leader.put(30)
        time.sleep(0.05)
        sink.close()  # killed: what it had not taken is gone with it (no clean close)
        for _ in range(5):
            leader.src.poll()
            time.sleep(0.01)
        # never acknowledged (the socket stream forgot the standby when its
        # connection closed: a member it does not know holds nothing)
        assert leader.src.acked_lsn() <= acked_lsn < leader.src.last_lsn

        store2, restored = _restart(cfg)
        assert store2.position is not None and store2.position.lsn == acked_lsn
        assert state(restored) == acked_state
        log_ = ReplicationLog()
        log_.reset(store2.position.epoch, store2.position.lsn, store2.position.history)
        sink2 = ReplicaSink(restored, "s1", store=store2, log_=log_, context=ctx, based=True)
        sink2.connect(leader.src.endpoint, 4)
        pump(leader, [sink2], lambda: leader.src.acked_lsn() == leader.src.last_lsn)
        assert sink2.stats.snapshots == 0  # the tail after what it held
        assert state(sink2.directory) == state(leader.d)
        sink2.close()
        store2.close([])
        store3, restored = _restart(cfg)
        assert state(restored) == state(leader.d)
        store3.close([])
    finally:
        sink.close()
        if sink2 is not None:
            sink2.close()
        store.close([])
        leader.src.close()


def test_corrupt_batch_frames_are_refused_and_the_standby_resyncs(ctx: zmq.Context) -> None:
    """A batch whose journal frames do not check (a checksum, the record
    count its header states) is neither applied nor acked: the standby says
    hello again from what it holds and goes on with the leader's stream."""
    from kvpool.master.ha.replication import Batch
    from kvpool.master.journal import encode_frames

    leader = Leader(ctx, epoch=3)
    sink = sink_for(ctx, "s1")
    try:
        sink.connect(leader.src.endpoint, 3)
        leader.mount("seg-a")
        leader.put(10)
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        held = leader.src.last_lsn
        good = encode_frames([[4, f"k{i:06d}"] for i in range(10)])
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF  # a flipped byte in the last record
        for frames, count in ((bytes(flipped), 10), (good, 11)):
            # sent as the next batch, bypassing the leader's log
            fake = Batch(3, held + 1, count, frames, [])
            ident = leader.src.standbys["s1"].ident  # a new one after each hello
            leader.src.transport.send(ident, fake.header(3), frames)
            deadline = time.monotonic() + 5
            while sink.state is not SinkState.CONNECTING:
                assert time.monotonic() < deadline
                sink.poll(0.01)
            assert sink.log.last_lsn == held and sink.stats.records == held
            assert len(sink.directory.objects) == 10  # the removes were not applied
            pump(leader, [sink], lambda: sink.state is SinkState.STREAMING)
        leader.put(5)
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        assert state(sink.directory) == state(leader.d)
        assert sink.stats.snapshots == 0  # its own position was good: a tail
    finally:
        sink.close()
        leader.src.close()


def test_tail_starting_inside_a_batch() -> None:
    """A tail from a position inside a logged batch re-encodes its rest."""
    from kvpool.master.ha.replication import Batch, decode_frames
    from kvpool.master.journal import check_frames, encode_frames

    recs = [[4, f"k{i}"] for i in range(10)]
    lg = ReplicationLog()
    lg.append(Batch(2, 1, 12, encode_frames(recs), [[100, {}], [101, []]]))
    lg.append(Batch(2, 13, 3, encode_frames(recs[:3]), []))
    tail = list(lg.tail_from(4) or ())
    assert [(b.first, b.length) for b in tail] == [(5, 8), (13, 3)]
    assert decode_frames(tail[0].frames) == recs[4:] and tail[0].extras == [[100, {}], [101, []]]
    assert check_frames(tail[0].frames) == 6
    only_extras = list(lg.tail_from(11) or ())
    assert [(b.first, b.length, b.frames, b.extras) for b in only_extras] == [
        (12, 1, b"", [[101, []]]), (13, 3, lg.ring[1].frames, [])]
    assert list(lg.tail_from(15) or [None]) == []  # holds everything
    big = encode_frames([[4, "x"]] * 5000)  # two frames
    assert check_frames(big) == 5000 and check_frames(big[:-1]) == -1


def test_standby_outside_the_in_sync_set_acks_lazily(ctx: zmq.Context) -> None:
    """Replies wait only for in-sync members: they ack every batch at once;
    a standby outside the set acks at most every ``LAZY_ACK_S`` (the
    leader wakes less), yet is seen holding everything soon after."""
    from kvpool.master.ha.sink import LAZY_ACK_S

    leader = Leader(ctx, epoch=8)
    s1, s2 = sink_for(ctx, "s1"), sink_for(ctx, "s2")
    try:
        for s in (s1, s2):
            s.connect(leader.src.endpoint, 8)
        leader.mount("seg-a")
        pump(leader, [s1, s2], lambda: sorted(leader.src.caught_up()) == ["s1", "s2"])
        leader.src.add_sync("s1")
        leader.src.heartbeat_s = 3600.0  # no heartbeats while counting: each is acked too
        acks = {"s1": 0, "s2": 0}
        idents = {leader.src.standbys[n].ident: n for n in acks}
        handle = leader.src._handle

        def counting(ident: bytes, msg: list[Any]) -> None:
            if msg[0] == 3:
                acks[idents[ident]] += 1
            handle(ident, msg)

        leader.src._handle = counting  # type: ignore[method-assign]
        t0 = time.monotonic()
        n = 0
        # at least 40 batches, over several lazy ack periods (a round trip can take ~0.1 ms)
        while n < 40 or time.monotonic() - t0 < 5 * LAZY_ACK_S:
            leader.put(5)
            n += 1
            last = leader.src.last_lsn
            deadline = time.monotonic() + 5
            while leader.src.acked_lsn() < last:  # the in-sync member: each batch
                assert time.monotonic() < deadline
                s1.poll(0.001)
                s2.poll(0)
                leader.src.poll()
        elapsed = time.monotonic() - t0
        assert acks["s1"] == n
        assert 0 < acks["s2"] <= elapsed / LAZY_ACK_S + 2, (acks, elapsed)
        pump(leader, [s1, s2], lambda: leader.src.caught_up() == ["s2"])
        assert state(s2.directory) == state(leader.d)
    finally:
        for s in (s1, s2):
            s.close()
        leader.src.close()


def test_batches_for_a_standby_outside_the_in_sync_set_are_sent_together(
        ctx: zmq.Context) -> None:
    """With ``lazy_send_s``, batches for a standby outside the in-sync set
    wait (at most that long) and leave together, merged into as few batches
    as their stream-only records allow (those close a batch): it writes and
    acks them with one write and one ack; the in-sync member gets each at
    once. What waits goes before anything else sent to that standby, and
    all of it once the standby joins the set."""
    leader = Leader(ctx, epoch=9, lazy_send_s=1.0)
    s1, s2 = sink_for(ctx, "s1"), sink_for(ctx, "s2")
    try:
        for s in (s1, s2):
            s.connect(leader.src.endpoint, 9)
        leader.mount("seg-a")
        pump(leader, [s1, s2], lambda: sorted(leader.src.caught_up()) == ["s1", "s2"])
        leader.src.add_sync("s1")
        before, records = s2.stats.batches, s2.stats.records
        for i in range(5):
            leader.put(3)
            if i == 1:
                leader.src.publish([], [[101, []]])  # stream-only: ends a merged batch
            last = leader.src.last_lsn
            deadline = time.monotonic() + 5
            while leader.src.acked_lsn() < last:  # the in-sync member: at once
                assert time.monotonic() < deadline
                s1.poll(0.001)
                s2.poll(0)
                leader.src.poll()
        assert s2.stats.batches == before and s2.log.last_lsn < last  # held back
        assert leader.src.lazy_due
        deadline = time.monotonic() + 5
        while s2.log.last_lsn < last:  # sent when due, by poll
            assert time.monotonic() < deadline
            leader.src.poll()
            s2.poll(0.01)
        assert s2.stats.batches == before + 2 and s2.stats.records == records + 16
        pump(leader, [s1, s2], lambda: leader.src.caught_up() == ["s2"])
        assert state(s2.directory) == state(leader.d)
        leader.put(2)  # held back again; joining the set sends it at once
        assert s2.log.last_lsn < leader.src.last_lsn
        leader.src.add_sync("s2")
        pump(leader, [s1, s2], lambda: leader.src.acked_lsn() == leader.src.last_lsn)
        assert state(s2.directory) == state(leader.d)
    finally:
        for s in (s1, s2):
            s.close()
        leader.src.close()


def test_apply_records_reserves_a_run_at_once_and_drops_what_is_not_free() -> None:
    """A standby reserves the space of new objects placed back to back with
    one allocator call; where part of that range is taken, object by object
    (those whose space is taken are dropped), as record-by-record replay."""
    src = Leader.__new__(Leader)  # only the directory part
    src.d, src.n = Directory(CFG), 0
    desc = SegmentDescriptor("seg-a", "client-a", "host", SegmentKind.MEMORY, 1 << 20, "shm-a")
    src.d.mount("client-a", desc)
    for size in (4096, 100, 4096, 1, 8192) * 4:
        code, _p = src.d.put_start("writer", f"k{src.n:03d}", size)
        assert code == 0 and src.d.put_end("writer", f"k{src.n:03d}") == 0
        src.n += 1
    recs = list(src.d.records)
    assert sum(1 for r in recs if r[0] == 3) == 20

    def replay(batched: bool, taken: tuple[int, int] | None) -> Directory:
        d = Directory(CFG)
        d.journaling = False
        d.apply_records(recs[:1])  # the mount
        if taken is not None:
            d.segments["seg-a"].alloc.reserve(*taken)
        if batched:
            assert d.apply_records(recs[1:]) == []
        else:
            for r in recs[1:]:
                d.apply_record(r)
        return d

    whole = replay(True, None)
    assert state(whole) == state(replay(False, None)) == state(src.d)
    a = whole.segments["seg-a"].alloc
    b = src.d.segments["seg-a"].alloc
    assert (a._starts, a._lens, a._by_size) == (b._starts, b._lens, b._by_size)
    # a range in the middle of the run already taken: those objects are dropped
    partial = replay(True, (8192, 64))
    assert state(partial) == state(replay(False, (8192, 64)))
    assert 0 < len(partial.objects) < 20


def test_standby_takes_a_bounded_number_of_messages_per_poll(ctx: zmq.Context) -> None:
    """A standby far behind takes at most ``SINK_DRAIN`` messages per poll,
    and everything it took is applied when poll returns (so the loop's other
    work runs between polls); the next poll goes on from there."""
    from kvpool.master.ha.sink import SINK_DRAIN

    leader = Leader(ctx, epoch=5)
    sink = sink_for(ctx, "s1")
    try:
        join(leader, sink, 5)
        base = sink.log.last_lsn
        for _ in range(SINK_DRAIN + 40):
            leader.put(1)
        time.sleep(0.3)  # every batch has arrived at the standby's socket (loopback)
        assert sink.poll(1.0) == SINK_DRAIN
        assert sink.log.last_lsn == base + SINK_DRAIN
        assert len(sink.directory.objects) == SINK_DRAIN
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        assert state(sink.directory) == state(leader.d)
    finally:
        sink.close()
        leader.src.close()


def test_leader_refuses_a_standby_of_another_replication_protocol(ctx: zmq.Context) -> None:
    """A standby of an older kvpool (a HELLO without the protocol, batches
    of decoded records) is refused with INVALID_VERSION instead of being
    streamed a format it cannot read (and never acking)."""

    leader = Leader(ctx, epoch=3)
    hello = msgspec.msgpack.encode([1, "old-standby", 0, 0, 0])
    if leader.src.endpoint.startswith(SOCKET_SCHEME):
        host, port = leader.src.endpoint[len(SOCKET_SCHEME):].rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=5)
        try:
            raw.sendall(struct.pack("<II", len(hello), 0) + hello)
            deadline = time.monotonic() + 5
            got = b""
            raw.setblocking(False)
            while len(got) < 8 or len(got) < 8 + struct.unpack_from("<I", got)[0]:
                assert time.monotonic() < deadline
                leader.src.poll()
                try:
                    got += raw.recv(65536)
                except BlockingIOError:
                    time.sleep(0.01)
            reply = msgspec.msgpack.decode(got[8:8 + struct.unpack_from("<I", got)[0]])
        finally:
            raw.close()
            leader.src.close()
    else:
        old = ctx.socket(zmq.DEALER)
        old.setsockopt(zmq.LINGER, 0)
        try:
            old.connect(leader.src.endpoint)
            old.send(hello)
            deadline = time.monotonic() + 5
            while not old.poll(10):
                assert time.monotonic() < deadline
                leader.src.poll()
            reply = msgspec.msgpack.decode(old.recv())
        finally:
            old.close(0)
            leader.src.close()
    assert reply[0] == 8 and reply[1] == int(ErrorCode.INVALID_VERSION), reply
    assert "old-standby" not in leader.src.standbys


def test_socket_stream_standby_dials_again_after_its_connection_breaks() -> None:
    """Socket transport: a broken connection (here closed by the leader, as
    when it replaces or forgets a standby) is seen by the standby at once: it
    stops polling the socket and records when (its loop dials again after
    ``_REDIAL_S``). Nothing sent meanwhile is acked; the new connection gets
    the tail, and its acks release the rest."""
    leader = Leader(None, epoch=4)  # type: ignore[arg-type]  # the socket transport: no ZeroMQ
    assert leader.src.endpoint.startswith(SOCKET_SCHEME)
    sink = ReplicaSink(Directory(CFG), "s1")
    try:
        join(leader, sink, 4)
        leader.src.add_sync("s1")
        assert sink.pollable is not None and not sink.dropped_at
        leader.src.transport.drop(leader.src.standbys["s1"].ident)
        leader.put(10)  # sent to the closed connection: lost
        deadline = time.monotonic() + 5
        while not sink.dropped_at:
            assert time.monotonic() < deadline
            leader.src.poll()
            sink.poll(0.01)
        assert sink.pollable is None  # its loop no longer polls the dead socket
        assert leader.src.acked_lsn() < leader.src.last_lsn
        sink.connect(leader.src.endpoint, 4)  # what follower_tick does after _REDIAL_S
        pump(leader, [sink], lambda: leader.src.acked_lsn() == leader.src.last_lsn)
        assert state(sink.directory) == state(leader.d)
        assert sink.stats.snapshots == 0  # the tail after what it held
        assert leader.src.transport.accepted == 2  # type: ignore[attr-defined]
    finally:
        sink.close()
        leader.src.close()


def test_socket_stream_is_never_used_where_curve_applies() -> None:
    """CURVE needs ZeroMQ: a socket stream where the policy wants CURVE is a
    configuration error at the leader and refused by a standby (no hello,
    nothing read)."""
    from kvpool.core.auth import CurveConfig
    from kvpool.core.config import ConfigError
    from kvpool.master.config import ReplicationTransport

    with pytest.raises(ConfigError, match="CURVE"):
        MasterConfig(replication_transport=ReplicationTransport.SOCKET,
                     curve=CurveConfig(enabled=True)).validate()
    sink = ReplicaSink(Directory(CFG), "s1", curve=CurveConfig(enabled=True))
    sink.connect(f"{SOCKET_SCHEME}127.0.0.1:9", 3)
    assert sink.state is SinkState.REFUSED and sink.conn is None
    assert "CURVE" in sink.refusal


def test_socket_stream_queues_what_the_kernel_does_not_take() -> None:
    """Socket transport: batches the kernel does not take (a standby that does
    not read) wait in the leader's buffer, never blocking its loop, and leave
    in order once the standby reads again."""
    leader = Leader(None, epoch=6)  # type: ignore[arg-type]  # the socket transport: no ZeroMQ
    sink = ReplicaSink(Directory(CFG), "s1")
    try:
        join(leader, sink, 6)
        peer = leader.src.standbys["s1"].ident
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        assert sink.conn is not None
        sink.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # type: ignore[attr-defined]
        t0 = time.monotonic()
        for _ in range(20):  # the standby does not read meanwhile
            leader.put(200)
        assert time.monotonic() - t0 < 5
        assert leader.src.transport.backlog(peer) > 0
        pump(leader, [sink], lambda: leader.src.caught_up() == ["s1"])
        assert leader.src.transport.backlog(peer) == 0
        assert state(sink.directory) == state(leader.d)
    finally:
        sink.close()
        leader.src.close()
