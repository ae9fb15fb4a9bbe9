"""Object events (``kvpool master --events-port``) with a real master process
and real SUB sockets: puts, removes, evictions, tier moves and segment loss
arrive in order with a gap-free seq; a late subscriber, one that lost
messages and one that outlived a master restart all resync to exactly the
master's state; a stalled subscriber never stalls the master; CURVE keeps
unauthenticated subscribers out. The publisher's HA hook, ack gate and batch
split are checked in-process."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpool.cluster.processes import MasterProcess, find_free_port
from kvpool.core.auth import CurveConfig, save_keypair
from kvpool.core.errors import ErrorCode
from kvpool.core.events import (
    TOPIC,
    Event,
    EventBatch,
    EventSubscriber,
    ObjectRemoved,
    ObjectStored,
    PoolView,
    Replica,
    ReplicaRemoved,
    SegmentAdded,
    SegmentRemoved,
    Tier,
    decode_message,
)
from kvpool.core.protocol import (
    BatchPutEnd,
    BatchPutStart,
    GetReplicaList,
    ListObjects,
    MountSegment,
    Ping,
    PutEnd,
    PutOptions,
    PutStart,
    Remove,
    SegmentKind,
    Stats,
    TierTaskDone,
    UnmountSegment,
)
from kvpool.core.rpc_client import MasterClient, MasterRPCError
from support.factories import segment_desc

pytestmark = pytest.mark.timeout(60)

KiB = 1024
DRAM = Tier.DRAM
DISK = Tier.DISK


class RawSub:
    """A plain SUB socket, read the way a router would: ``[topic, seq, batch]``."""

    def __init__(self, port: int, rcvhwm: int = 0, rcvbuf: int = -1,
                 curve: CurveConfig | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf > 0:
            self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        if curve is not None:
            curve.setup_client(self.sock, "127.0.0.1")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.got: list[EventBatch] = []

    def recv(self, timeout_s: float) -> EventBatch | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        msg = self.sock.recv()
        assert msg.startswith(TOPIC)
        batch = decode_message(msg)
        self.got.append(batch)
        return batch

    def until(self, done: Callable[[list[Event]], bool], timeout_s: float = 10.0) -> list[Event]:
        """Receive until ``done(every event so far)``; return those events."""
        deadline = time.monotonic() + timeout_s
        while not done(self.events()):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; events so far: {self.events()}"
            self.recv(left)
        return self.events()

    def events(self) -> list[Event]:
        return [ev for b in self.got for ev in b.events]

    def close(self) -> None:
        self.sock.close(0)


def assert_gap_free(got: list[EventBatch]) -> None:
    """Batches numbered 1, 2, ... of one stream; heartbeats repeat the last seq."""
    last = 0
    assert len({b.stream for b in got}) == 1
    for batch in got:
        assert batch.epoch == 0
        if batch.events:
            assert batch.seq == last + 1, [b.seq for b in got]
            last = batch.seq
        else:
            assert batch.seq == last, [b.seq for b in got]


def listing(c: MasterClient, page: int = 4096, prefix: str = "") -> dict[str, ObjectStored]:
    out: dict[str, ObjectStored] = {}
    cursor = 0
    while True:
        r = c.call(ListObjects(cursor, page, prefix))
        for o in r.objects:
            assert o.key not in out  # each key on one page only
            out[o.key] = o
        cursor = r.next_cursor
        if not cursor:
            return out


def put(c: MasterClient, key: str, size: int = 100, client: str = "c1",
        **kw: Any) -> None:
    c.call(PutStart(client, key, size, PutOptions(**kw) if kw else None))
    c.call(PutEnd(client, key))


def batch_put(c: MasterClient, keys: list[str], size: int = 100, client: str = "c1") -> None:
    r = c.call(BatchPutStart(client, keys, [size] * len(keys)))
    assert not any(r.codes), r.codes
    assert not any(c.call(BatchPutEnd(client, keys)).codes)


def events_master(tmp_path: Path | None, *extra: str, **kw: Any) -> tuple[MasterProcess, int]:
    port = find_free_port()
    m = MasterProcess(data_dir=str(tmp_path / "data") if tmp_path else None,
                      extra_args=["--events-port", str(port), *extra], **kw)
    return m, port


@pytest.fixture
def master_events(tmp_path: Path) -> Iterator[tuple[MasterProcess, int]]:
    m, port = events_master(tmp_path)
    with m:
        yield m, port


# ---------------------------------------------------------------- process tests


@pytest.mark.parametrize("durable", [True, False], ids=["data_dir", "no_data_dir"])
def test_puts_removes_evictions_and_segment_loss_in_order(tmp_path: Path,
                                                         durable: bool) -> None:
    m, port = events_master(tmp_path if durable else None, "--client-grace-s", "0",
                            client_ttl_s=1.0)
    with m, m.client() as c:
        sub = RawSub(port)
        try:
            hello = sub.recv(5.0)  # greeted on subscribing
            assert hello is not None and hello.events == [] and hello.seq == 0
            c.call(MountSegment("c1", segment_desc("m1", "c1", 1 << 20, host_id="h1")))
            put(c, "a")
            batch_put(c, [f"b{i}" for i in range(4)])
            c.call(Remove("a"))
            expected: list[Event] = [
                SegmentAdded("m1", DRAM, "h1", 1 << 20),
                ObjectStored("a", 100, [Replica("m1", DRAM)]),
                *[ObjectStored(f"b{i}", 100, [Replica("m1", DRAM)]) for i in range(4)],
                ObjectRemoved("a"),
            ]
            assert sub.until(lambda evs: len(evs) >= len(expected)) == expected
            # fill the 1 MiB segment: the master evicts the least recently used objects
            for i in range(10):
                put(c, f"e{i}", 200 * KiB)
            evictions = c.call(Stats()).evictions
            assert evictions > 0
            evs = sub.until(lambda evs: any(getattr(e, "key", "") == "e9" for e in evs))
            tail = evs[len(expected):]
            stored = [e.key for e in tail if type(e) is ObjectStored]
            evicted = [e.key for e in tail if type(e) is ObjectRemoved]
            assert stored == [f"e{i}" for i in range(10)]
            assert len(evicted) == evictions
            assert evicted[:4] == [f"b{i}" for i in range(4)]  # least recently used first
            for key in evicted:  # each removal follows the key's store
                mine = [e for e in evs if getattr(e, "key", "") == key]
                assert [type(e) for e in mine] == [ObjectStored, ObjectRemoved]
            # the events replayed give exactly what the master lists
            view = PoolView()
            view.apply_all(evs)
            assert view.objects == listing(c)
            # segment loss: an unmount, and an owner that went silent (ttl 1 s, no grace)
            c.call(MountSegment("c2", segment_desc("m2", "c2", 1 << 20, host_id="h2")))
            put(c, "on-m2", 100, preferred_segments=["m2"])
            c.call(UnmountSegment("c1", "m1"))
            evs = sub.until(lambda evs: SegmentRemoved("m2") in evs, timeout_s=15)
            view = PoolView()
            view.apply_all(evs)
            assert evs[-4:] == [SegmentAdded("m2", DRAM, "h2", 1 << 20),
                                ObjectStored("on-m2", 100, [Replica("m2", DRAM)]),
                                SegmentRemoved("m1"), SegmentRemoved("m2")]
            assert view.objects == {} == listing(c) and view.segments == {}
            assert_gap_free(sub.got)
        finally:
            sub.close()


def test_tier_moves_are_stored_events(master_events: tuple[MasterProcess, int]) -> None:
    m, port = master_events
    with m.client() as c:
        sub = RawSub(port)
        try:
            assert sub.recv(5.0) is not None
            c.call(MountSegment("c1", segment_desc("m1", "c1", 1 << 20)))
            c.call(MountSegment("c1", segment_desc("f1", "c1", 8 << 20, SegmentKind.FILE)))
            # 10 x 100 KiB in 1 MiB: eviction offloads to disk (and copies ahead)
            keys = [f"k{i}" for i in range(10)]
            for k in keys:
                put(c, k, 100 * KiB)
            tasks = c.call(Ping("c1")).tasks
            assert tasks
            for t in tasks:
                c.call(TierTaskDone("c1", t.id, True))
            moved = {t.key: t.kind for t in tasks}
            evs = sub.until(lambda evs: sum(type(e) is ObjectStored for e in evs) >= 10
                            + len(moved))
            stored = [e for e in evs if type(e) is ObjectStored][10:]
            assert [e.key for e in stored] == [t.key for t in tasks]
            for e in stored:
                if moved[e.key] == 1:  # offload: memory freed, on disk only
                    assert e.replicas == [Replica("f1", DISK)]
                else:  # copy ahead: on both tiers
                    assert sorted(e.replicas, key=lambda r: r.tier) == \
                        [Replica("f1", DISK), Replica("m1", DRAM)]
            # promotion: reads of a disk-only object copy it back into memory
            # (at its promote_after_hits-th read)
            cold = next(k for k, kind in moved.items() if kind == 1)
            promote: list[Any] = []
            for _ in range(5):
                c.call(GetReplicaList(cold))
                promote = [t for t in c.call(Ping("c1")).tasks if t.key == cold]
                if promote:
                    break
            assert [t.kind for t in promote] == [2]
            c.call(TierTaskDone("c1", promote[0].id, True))
            evs = sub.until(lambda evs: sum(getattr(e, "key", "") == cold for e in evs) >= 3)
            last = [e for e in evs if getattr(e, "key", "") == cold][-1]
            assert type(last) is ObjectStored
            assert {r.tier for r in last.replicas} == {DRAM, DISK}
            view = PoolView()
            view.apply_all(evs)
            assert view.objects == listing(c)
            assert_gap_free(sub.got)
        finally:
            sub.close()


def test_late_subscriber_resyncs_and_follows_a_restart(
        master_events: tuple[MasterProcess, int]) -> None:
    m, port = master_events
    with m.client() as c:
        c.call(MountSegment("c1", segment_desc("m1", "c1", 64 << 20)))
        for b in range(6):
            batch_put(c, [f"model-a/{b}/{i}" for i in range(500)], 64)
        batch_put(c, [f"model-b/{i}" for i in range(50)], 64)
        for i in range(0, 500, 7):
            c.call(Remove(f"model-a/0/{i}"))
        # late: 3000 objects exist; pages of 256 (whole shards) cover them once
        with EventSubscriber(f"tcp://127.0.0.1:{port}", c, page_size=256) as sub:
            sub.sync()
            assert sub.view.objects == listing(c) and len(sub.view) == 3050 - 72
            assert set(sub.view.segments) == {"m1"}
            batch_put(c, [f"model-c/{i}" for i in range(100)], 64)
            c.call(Remove("model-b/3"))
            got = sub.poll(2.0)
            while len(got) < 101:
                more = sub.poll(2.0)
                assert more, got
                got += more
            assert sub.view.objects == listing(c) and sub.resyncs == 1
            # a master restart (same data dir): a new stream, so the view is rebuilt
            before = listing(c)
            m.restart()
            deadline = time.monotonic() + 20
            while sub.resyncs < 2:
                assert time.monotonic() < deadline
                try:
                    sub.poll(0.5)
                except MasterRPCError:
                    pass  # the listing raced the restart; the next poll retries
            assert sub.view.objects == before == listing(c)
        c.call(Ping("c1"))  # the segment's owner is back: it takes placements again
        # a prefix: only that model's keys
        with EventSubscriber(f"tcp://127.0.0.1:{port}", c, prefix="model-b/") as sub:
            sub.sync()
            assert set(sub.view.objects) == {f"model-b/{i}" for i in range(50)} - {"model-b/3"}
            batch_put(c, ["model-b/x", "model-a/x"])
            got = []
            while not got:
                got = sub.poll(2.0)
            assert "model-b/x" in sub.view.objects and "model-a/x" not in sub.view.objects


def test_stalled_subscriber_never_stalls_the_master(tmp_path: Path) -> None:
    cfg = tmp_path / "master.yaml"
    cfg.write_text("events_hwm: 100\n")
    port = find_free_port()
    metrics = find_free_port()
    m = MasterProcess(metrics_port=metrics,
                      extra_args=["--events-port", str(port), "--config", str(cfg)])
    with m, m.client() as c:
        c.call(MountSegment("c1", segment_desc("m1", "c1", 256 << 20)))
        ep = f"tcp://127.0.0.1:{port}"
        # stalled: reads nothing after its sync, holds one message, tiny kernel buffer
        stalled = EventSubscriber(ep, c, rcvhwm=1)
        stalled.sock.setsockopt(zmq.RCVBUF, 4096)
        fast = EventSubscriber(ep, c)
        try:
            stalled.sync()
            fast.sync()
            # 300 batches of 50 events of ~1 KiB keys: ~15 MB the stalled one cannot take
            t0 = time.monotonic()
            for b in range(300):
                batch_put(c, [f"{b:04d}/{i:02d}/" + "x" * 1000 for i in range(50)], 64)
                fast.poll(0)
            put_s = time.monotonic() - t0
            # the last put's batch is published after its reply (once per loop
            # turn) and the page is a copy made per scrape: poll it briefly
            deadline = time.monotonic() + 5
            while True:
                text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics",
                                              timeout=5).read().decode()
                if "kvpool_master_events_batches_total 301.0" in text \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            dropped = [float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("kvpool_master_events_dropped_total")]
            assert dropped and dropped[0] >= 1, text[-2000:]
            assert "kvpool_master_events_batches_total 301.0" in text  # the mount's too
            # the fast subscriber got every batch while the stalled one was dropped
            while fast.seq < 301:
                assert fast.poll(5.0), fast.seq
            assert fast.resyncs == 1 and fast.batches == 300
            assert len(fast.view) == 15000
            # the stalled one sees its gap and resyncs to the same state
            deadline = time.monotonic() + 20
            while stalled.resyncs < 2 or stalled.seq < 301:
                assert time.monotonic() < deadline
                stalled.poll(0.5)
            assert stalled.view.objects == fast.view.objects == listing(c)
            print(f"300 batch puts in {put_s:.2f}s beside a stalled subscriber")
        finally:
            stalled.close()
            fast.close()


def test_curve_keeps_unauthenticated_subscribers_out(tmp_path: Path) -> None:
    pub, sec = save_keypair(tmp_path / "keys", "cluster")
    port = find_free_port()
    m = MasterProcess(curve_key=str(sec), extra_args=["--events-port", str(port)])
    with m, m.client() as c:
        curve = CurveConfig(secret_key_file=str(sec), enabled=True)
        intruder = RawSub(port)  # no CURVE: the handshake never completes
        _, other = save_keypair(tmp_path / "keys", "other")
        stranger = RawSub(port, curve=CurveConfig(secret_key_file=str(other), enabled=True,
                                                  server_public_key_file=str(pub)))
        try:
            with EventSubscriber(f"tcp://127.0.0.1:{port}", c, curve=curve) as sub:
                sub.sync()
                c.call(MountSegment("c1", segment_desc("m1", "c1", 1 << 20)))
                put(c, "secret")
                got: list[Event] = []
                while len(got) < 2:
                    more = sub.poll(5.0)
                    assert more
                    got += more
                assert got[1] == ObjectStored("secret", 100, [Replica("m1", DRAM)])
            assert intruder.recv(0.5) is None and stranger.recv(0.5) is None
            assert c.call(Stats()).curve_denied >= 1  # the stranger's key was refused
        finally:
            intruder.close()
            stranger.close()


def test_list_objects_rejects_bad_pages_and_keeps_serving(
        master_events: tuple[MasterProcess, int]) -> None:
    m, _port = master_events
    with m.client() as c:
        for bad in (ListObjects(-1), ListObjects(256), ListObjects(0, 0)):
            with pytest.raises(MasterRPCError) as ei:
                c.call(bad)
            assert ei.value.code == ErrorCode.INVALID_PARAMS
        with pytest.raises(MasterRPCError) as ei:
            c.call_raw(70, ["not a cursor"])
        assert ei.value.code == ErrorCode.INVALID_PARAMS
        r = c.call(ListObjects())
        assert r.objects == [] and r.next_cursor == 0 and r.stream != 0


# ---------------------------------------------------------------- in-process: the publisher


def _publisher(**cfg: Any) -> tuple[Any, RawSub]:
    from kvpool.master.config import MasterConfig
    from kvpool.master.directory import Directory
    from kvpool.master.events import EventPublisher

    port = find_free_port()
    mcfg = MasterConfig(port=0, events_port=port, **cfg)
    pub = EventPublisher(mcfg, zmq.Context.instance(), Directory(mcfg))
    sub = RawSub(port)
    deadline = time.monotonic() + 5
    while not sub.got:  # the greeting heartbeat: the subscription is live
        assert time.monotonic() < deadline
        pub.flush(0, time.monotonic())
        sub.recv(0.05)
    sub.got.clear()
    return pub, sub


def test_publisher_ha_hook_ack_gate_and_split() -> None:
    from kvpool.master.events import MAX_EVENTS
    from kvpool.master.records import DropReplica, Mount, Put, Remove

    pub, sub = _publisher()
    try:
        now = time.monotonic()
        wire = segment_desc("m1", "c1").to_wire()
        pub.on_commit([Mount(wire), Put("k", 10, 0, None, ["m1", 0])], 1)
        pub.on_commit([DropReplica("k", "m1")], 2)
        pub.flush(1, now)  # the ack gate allows commit 1 only
        batch = sub.recv(2.0)
        assert batch is not None and batch.seq == 1 and batch.epoch == 0
        assert batch.events == [SegmentAdded("m1", DRAM, "host-test", 1 << 20),
                                ObjectStored("k", 10, [Replica("m1", DRAM)])]
        assert sub.recv(0.1) is None
        pub.term = lambda: 7  # a leader of epoch 7
        pub.flush(2, now)
        batch = sub.recv(2.0)
        assert batch is not None and batch.seq == 2 and batch.epoch == 7
        assert batch.events == [ReplicaRemoved("k", "m1")]
        assert pub.position() == (pub.stream, 2, 7)
        pub.term = lambda: None  # a standby: translates, publishes nothing
        pub.on_commit([Remove("k")], 3)
        pub.flush(3, now + 5)
        assert sub.recv(0.2) is None and pub.seq == 2
        pub.term = lambda: 8
        pub.on_commit([Remove(f"k{i}") for i in range(2 * MAX_EVENTS + 5)], 4)
        pub.flush(4, now)
        got = [sub.recv(2.0) for _ in range(3)]
        assert [(b.seq, len(b.events)) for b in got if b] == \
            [(3, MAX_EVENTS), (4, MAX_EVENTS), (5, 5)]
        pub.flush(4, now + 2)  # idle: a heartbeat repeating the last seq
        batch = sub.recv(2.0)
        assert batch is not None and batch.seq == 5 and batch.events == [] and batch.epoch == 8
        assert pub.stats()["heartbeats"] >= 2 and pub.stats()["batches"] == 5
        # a commit that cannot be translated never raises into the loop: the
        # stream starts anew, so every subscriber resyncs
        stream = pub.stream
        pub.on_commit([Remove("a"), Mount({})], 5)
        pub.flush(5, now)
        batch = sub.recv(2.0)
        assert batch is not None and pub.stream != stream
        assert (batch.stream, batch.seq, batch.events) == (pub.stream, 1, [ObjectRemoved("a")])
    finally:
        sub.close()
        pub.close()


def test_example_subscriber_script(master_events: tuple[MasterProcess, int]) -> None:
    import json
    import subprocess
    import sys

    m, port = master_events
    script = Path(__file__).resolve().parents[2] / "scripts" / "kv_events.py"
    with m.client() as c:
        c.call(MountSegment("c1", segment_desc("m1", "c1", 1 << 20)))
        put(c, "before")
        proc = subprocess.Popen([sys.executable, str(script), "--events",
                                 f"tcp://127.0.0.1:{port}", "--master", m.address,
                                 "--count", "2"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            synced = json.loads(proc.stdout.readline())["synced"]
            assert synced["objects"] == 1 and synced["tiers"] == {
                "dram": {"objects": 1, "bytes": 100}}
            put(c, "after", 300)
            c.call(Remove("before"))
            out, _ = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = [json.loads(line) for line in out.splitlines()]
        assert lines[:2] == [
            {"event": "stored", "key": "after", "size": 300, "replicas": [["m1", "dram"]]},
            {"event": "removed", "key": "before"}]
        assert lines[2]["summary"]["objects"] == 1 and lines[2]["summary"]["resyncs"] == 1
        assert proc.returncode == 0
