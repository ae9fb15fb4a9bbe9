"""One master instance of an HA group: the election and replication wired
into the master's event loop (docs/ha.md).

:class:`HaNode` is created by :class:`kvpool.master.server.MasterServer`
when ``MasterConfig.etcd`` is set. The server's loop then alternates:

- **follower**: a :class:`~.sink.ReplicaSink` follows the leader
  named in etcd and applies its journal batches to a directory held in
  memory; every client request is answered ``NOT_LEADER`` (the message
  names the leader's address and epoch). No timer mutates the directory.
- **leader** (elected): the sink's directory is promoted (every replicated
  segment active, owners treated as just seen) and served by the ordinary
  loop; each group commit is published to the standbys
  (:meth:`on_commit`) and the loop's ack gate (:meth:`acked`) releases the
  replies of a commit only once ``sync_standbys`` in-sync standbys hold it
  and the fencing deadline has not passed (``Elector.may_acknowledge``).
  Changes of the in-sync set are written to etcd by a
  :class:`~.election.SyncWriter` thread: the loop never waits on etcd.
  A leader that is deposed (its campaign key gone or replaced) drops the
  replies it still holds (never acknowledged) and becomes a follower again,
  keeping its log position so the new leader can send a tail or a snapshot.

Stream-only records (tags >= 100, never journaled): ``[KEYS, {segment id:
key}]`` carries the capability keys so a new leader signs tokens the node
daemons accept; ``[SOFT_PINS, [[key, deadline ms], ...]]`` the soft pin
deadlines (the PUT record carries only the flag).

A new leader counts every object as read-leased for one lease TTL (read
leases are not replicated). While its lease is unconfirmed (``FENCED``) it
refuses writes and its mutating timers pause (``MasterServer._serve``); it
refuses writes too (``NOT_ENOUGH_STANDBYS``, before applying them) while
the in-sync set is short of ``sync_standbys`` (:attr:`InSyncSet.short`).
Refusals leave at once, never held for acks; reads go on.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvpool.core.capability import CapabilitySigner
from kvpool.core.errors import ErrorCode
from kvpool.core.etcd import LeaderInfo, MemberInfo, parse_etcd_url
from kvpool.core.protocol import Op, encode_error, peek_id
from kvpool.master.config import MasterConfig, ReplicationTransport
from kvpool.master.directory import SOFT_PIN, Directory
from kvpool.master.durability import StreamPosition
from kvpool.master.ha.election import ElectionConfig, Elector, Role, SyncWriter
from kvpool.master.ha.in_sync import InSyncSet
from kvpool.master.ha.replication import ReplicationLog
from kvpool.master.ha.sink import ReplicaSink, ReplicaStore, SinkState, promote_directory
from kvpool.master.ha.source import ReplicationSource
from kvpool.master.ha.transport import SOCKET_SCHEME, listen_tcp
from kvpool.master.records import DirRecord, Put
from kvpool.master.stats import HaStandbyStats, HaStats

__all__ = ["KEYS_RECORD", "SOFT_PINS_RECORD", "HaNode"]

log = logging.getLogger(__name__)

#: stream-only record ``[KEYS_RECORD, {segment_id: key}]`` (never journaled)
KEYS_RECORD = 100
#: stream-only record ``[SOFT_PINS_RECORD, [[key, deadline], ...]]``: soft pin
#: deadlines (wall clock, ms since the epoch) of objects whose PUT record says
#: SOFT_PIN; the journal keeps only the flag
SOFT_PINS_RECORD = 101
#: ops that change the directory: refused while the leader is fenced
_WRITES = frozenset(int(o) for o in (
    Op.MOUNT_SEGMENT, Op.UNMOUNT_SEGMENT, Op.PUT_START, Op.PUT_END, Op.PUT_REVOKE, Op.REMOVE,
    Op.PUT_COMMIT, Op.REMOVE_ALL, Op.REMOVE_BY_REGEX, Op.UPSERT_START, Op.BATCH_PUT_START,
    Op.BATCH_PUT_END, Op.BATCH_PUT_COMMIT,
    Op.BATCH_PUT_REVOKE, Op.BATCH_REMOVE, Op.BATCH_UPSERT_START, Op.BATCH_REPLICA_CLEAR,
    Op.TIER_TASK_DONE, Op.CREATE_COPY_TASK, Op.CREATE_MOVE_TASK, Op.TENANT_SET))
_REBIND_S = 2.0  # how long promote waits for the replication port to be free
_RECONNECT_S = 1.0  # a sink silent this long (no batch, no heartbeat) says hello again
#: batches for a standby outside the in-sync set are sent together, at most this
#: long after the first (ReplicationSource.lazy_send_s): such a standby wakes
#: once for several; it acks lazily within as long (sink.LAZY_ACK_S)
LAZY_SEND_S = 0.01


_HOLD_RETRY_S = 0.1  # a deposed leader takes its port back this often until it can
#: a standby whose socket-transport connection broke dials again after this
#: long (as ZeroMQ's reconnect interval), unless the leader refused it
_REDIAL_S = 0.1


def _hold_port(host: str, port: int) -> socket.socket:
    """Take ``host:port`` (0: a free port) for as long as the socket is open: a
    TCP listener. While an instance does not lead, nothing accepts on it: it
    keeps the replication port it advertises, so no other process can listen
    there and the kernel gives it to no outgoing connection, and the port is
    still free when the instance is elected. The socket transport serves this
    listener itself once elected (standbys that dialed early wait in its
    backlog); ZeroMQ binds the port anew."""
    return listen_tcp(host, port)


class HaNode:
    """Election + replication state of one instance (loop thread, except
    :meth:`health`, which reads plain attributes)."""

    def __init__(self, cfg: MasterConfig, rpc_port: int, metrics_port: int,
                 signer: CapabilitySigner | None,
                 make_directory: Callable[[], Directory], context: Any) -> None:
        assert cfg.etcd
        self.cfg = cfg
        target = parse_etcd_url(cfg.etcd, cfg.cluster_id or None)
        advertise = cfg.advertise or f"{cfg.host}:{rpc_port}"
        adv_host = advertise.rsplit(":", 1)[0]
        # the replication port, held from now on whenever no source is bound to it
        try:
            self._hold: socket.socket | None = _hold_port(cfg.host, cfg.replication_port)
        except OSError as exc:
            raise OSError(exc.errno, f"replication port {cfg.host}:{cfg.replication_port}: "
                          f"{exc.strerror}") from exc
        self._next_hold = 0.0
        self.repl_port = int(self._hold.getsockname()[1])
        # the socket transport unless CURVE applies to the stream (config.validate
        # refuses the socket transport forced where it does)
        mode = cfg.replication_transport
        #: the stream is served on the loop (socket://), not by ZeroMQ
        self.plain = mode is ReplicationTransport.SOCKET or (
            mode is ReplicationTransport.AUTO and not cfg.curve.active(cfg.host))
        scheme = SOCKET_SCHEME if self.plain else "tcp://"
        self.repl_bind = f"{scheme}{cfg.host}:{self.repl_port}"
        self.me = MemberInfo(
            instance_id=advertise, address=advertise,
            metrics=f"{adv_host}:{metrics_port}" if metrics_port else "",
            replication=f"{scheme}{adv_host}:{self.repl_port}")
        self.signer = signer
        self.make_directory = make_directory
        self.ctx = context
        self.elector = Elector(ElectionConfig.for_target(
            target, lease_ttl_s=cfg.ha_lease_ttl_s), self.me)
        self.elector.member_ready = self._holds_replicated_state
        # writes the in-sync set off the loop thread (the loop never waits on etcd)
        self.sync_writer = SyncWriter(self.elector.cfg, self.me.instance_id)
        #: leader: the in-sync set (replies wait for its acks)
        self.in_sync = InSyncSet(self.sync_writer, self.me.instance_id, cfg.sync_standbys,
                                 cfg.sync_timeout_s)
        self.log = ReplicationLog()
        self.sink: ReplicaSink | None = None
        self.source: ReplicationSource | None = None
        #: the data dir a follower journals the stream to (None: not kept)
        self.store: ReplicaStore | None = None
        #: called after stream records changed the segment keys (save them)
        self.on_keys: Callable[[], None] | None = None
        self.epoch = 0  # the term this instance serves (0: not serving)
        self.serving = False
        self.streamed = False  # the sink received state from some leader
        self.keys_dirty = False
        # leader: (commit number, last lsn) of commits not yet released
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self._released = 0
        self._next_sync_check = 0.0
        # refusal replies made since the loop last took them: they reveal no
        # state, so they leave at once instead of queueing behind held replies
        self.refusals: list[bytes] = []
        # each standby's session object as last seen: a new one is a (re)join
        self._standbys_seen: dict[str, object] = {}
        self._sessions_seen = -1  # ReplicationSource.sessions when last looked at
        self.promotions = 0
        self.demotions = 0

    def start(self) -> None:
        self.elector.start()

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None
        if self.source is not None:
            self.source.close()
            self.source = None
        self._release_port()
        self.sync_writer.close()
        self.elector.close(resign=True)

    # ================================================================ follower
    def leader_info(self) -> LeaderInfo | None:
        return self.elector.state().leader

    def not_leader_reply(self, payload: bytes) -> bytes:
        """The reply of a follower to any client request."""
        leader = self.elector.state().leader
        where = (f"leader is {leader.address} (epoch {leader.epoch})" if leader is not None
                 and leader.instance_id != self.me.instance_id else "no leader serves now")
        return encode_error(peek_id(payload), ErrorCode.NOT_LEADER,
                            f"master {self.me.address} is a follower: {where}")

    def begin_follower(self, directory: Directory | None,
                       position: StreamPosition | None = None) -> ReplicaSink:
        """A sink over ``directory``: None, a fresh one (position 0; the data dir
        keeps its state until the leader's whole state arrived); with
        ``position``, the state a standby journaled (restored from the data
        dir); else the directory this instance served, at its own position."""
        self.serving = False
        self.epoch = 0
        based = True
        if directory is None:
            directory = self.make_directory()
            self.log = ReplicationLog()
            based = False
        elif position is not None:
            self.log = ReplicationLog()
            self.log.reset(position.epoch, position.lsn, position.history)
        self.sink = ReplicaSink(directory, self.me.instance_id, store=self.store,
                                make_directory=self.make_directory,
                                on_record=self._stream_record, log_=self.log, context=self.ctx,
                                curve=self.cfg.curve, based=based)
        return self.sink

    def _holds_replicated_state(self) -> bool:
        """Does this instance hold the state the in-sync set lists it for?
        (Elector thread.) Not before its sink completed a join in this run (a
        restarted standby holds nothing the stream gave its earlier run),
        nor while a snapshot replaces its directory."""
        sink = self.sink
        if sink is None:
            return True  # serving (or closing): the elector does not campaign then
        return sink.state is not SinkState.SNAPSHOT \
            and (self.streamed or sink.log.last_lsn > 0)

    def _stream_record(self, rec: list[Any]) -> None:
        if len(rec) < 2:
            return
        if rec[0] == KEYS_RECORD and self.signer is not None and isinstance(rec[1], dict):
            self.signer.load_keys({str(k): bytes(v) for k, v in rec[1].items()
                                   if isinstance(v, bytes | bytearray)})
            if self.on_keys is not None:
                self.on_keys()  # a restarted standby signs with the keys it had
        elif rec[0] == SOFT_PINS_RECORD and self.sink is not None:
            d = self.sink.directory
            # wall-clock deadlines: the record may be replayed later (a tail)
            base = d.clock() - time.time()
            soft = d.soft_until
            for key, deadline_ms in rec[1]:
                soft[str(key)] = base + deadline_ms / 1000

    @staticmethod
    def _soft_pins(d: Directory, keys: Any) -> list[Any]:
        """``[SOFT_PINS_RECORD, ...]`` of those ``keys`` that have a soft pin deadline."""
        soft = d.soft_until
        delta_ms = (time.time() - d.clock()) * 1000
        return [SOFT_PINS_RECORD, [[k, round(soft[k] * 1000 + delta_ms)] for k in keys
                                   if k in soft]]

    def _release_port(self) -> None:
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def _retake_port(self) -> None:
        """Hold the replication port again after a source let it go (ZeroMQ
        closes its listener asynchronously: retried until it is free)."""
        now = time.monotonic()
        if self._hold is not None or self.source is not None or now < self._next_hold:
            return
        try:
            self._hold = _hold_port(self.cfg.host, self.repl_port)
        except OSError as exc:
            self._next_hold = now + _HOLD_RETRY_S
            log.debug("replication port %d not held yet: %s", self.repl_port, exc)

    def follower_tick(self) -> bool:
        """Follow the leader etcd names; True once this instance is elected."""
        st = self.elector.state()
        sink = self.sink
        assert sink is not None
        if st.role is Role.LEADER:
            return True
        self._retake_port()
        if st.epoch:
            sink.observe_epoch(st.epoch)
        leader = st.leader
        if leader is None or leader.instance_id == self.me.instance_id \
                or not leader.replication:
            return False
        now = time.monotonic()
        if sink.endpoint != leader.replication or sink.leader_epoch != leader.epoch:
            log.info("%s: following %s (epoch %d) from lsn %d", self.me.instance_id,
                     leader.address, leader.epoch, sink.log.last_lsn)
            sink.connect(leader.replication, leader.epoch)
        elif sink.dropped_at and sink.state is not SinkState.REFUSED \
                and now - sink.dropped_at > _REDIAL_S:
            sink.connect(leader.replication, leader.epoch)  # the connection broke
        elif sink.state in (SinkState.CONNECTING, SinkState.REFUSED) \
                and now - sink.stats.last_message > _RECONNECT_S:
            sink.connect(leader.replication, leader.epoch)
        elif now - sink.stats.last_message > 3 * _RECONNECT_S:
            sink.connect(leader.replication, leader.epoch)  # silent stream: hello again
        if sink.state is SinkState.STREAMING:
            self.streamed = True
        return False

    # ================================================================ leader
    def promote(self, restored: Directory) -> Directory:
        """Elected: the directory to serve (the sink's if this instance ever
        followed a leader, else ``restored``, its own data dir's) and the
        replication source for the standbys."""
        st = self.elector.state()
        sink = self.sink
        if sink is not None and (self.streamed or sink.log.last_lsn > 0):
            d = sink.directory
            n = promote_directory(d)
            log.info("%s: promoted with %d objects, %d segments (%d re-activated), lsn %d",
                     self.me.instance_id, len(d.objects), len(d.segments), n,
                     self.log.last_lsn)
        else:
            d = restored
            d.journaling = True
            if self.log.last_lsn == 0:
                # a directory that did not come from the stream: joiners need a snapshot
                self.log.reset(st.epoch, 1, [(st.epoch, 1)])
        if sink is not None:
            sink.close()
            self.sink = None
        # read leases are not replicated: a reader of the old term may still be
        # copying any object, so every object counts as leased for one lease TTL
        # (the old leader granted its last lease before its fencing deadline,
        # which passed before this election)
        d.objects.lease_grace_until = d.clock() + d.lease_s
        self.epoch = st.epoch
        self.source = self._bind_source(d, st.epoch)
        self._pending.clear()
        self._released = 0
        self.in_sync.reset(st.epoch)  # the set starts empty: standbys join
        self._standbys_seen = {}
        self._sessions_seen = -1
        self.keys_dirty = True
        self.promotions += 1
        self.serving = True
        # name this term in the set at once (only this instance eligible until
        # standbys join); the write goes on in the background
        self.in_sync.submit(self.source, frozenset())
        return d

    @property
    def _silent_s(self) -> float:
        """A standby that acked nothing, not even a heartbeat, this long counts
        as gone until it acks again: six times the ack wait of an in-sync
        member (3 s by default, as long as a standby waits on a silent
        stream before it says hello again), so a standby slowed by a loaded
        host is not taken for a dead one (at twice, one was under 3 busy
        loops on 2 cores)."""
        return 6 * self.cfg.sync_timeout_s

    def _bind_source(self, d: Directory, epoch: int) -> ReplicationSource:
        """The replication source on our port: the socket transport serves the
        held listener; ZeroMQ binds it anew. A leader deposed and elected
        again at once binds the port its last source just closed: ZeroMQ
        releases it asynchronously, so retry briefly."""
        if self.plain and self._hold is not None:
            return ReplicationSource(d, self.repl_bind, epoch, self.log,
                                     lazy_send_s=LAZY_SEND_S, listener=self._hold,
                                     silent_s=self._silent_s)
        self._release_port()
        deadline = time.monotonic() + _REBIND_S
        while True:
            try:
                return ReplicationSource(d, self.repl_bind, epoch, self.log, self.ctx,
                                         curve=self.cfg.curve, lazy_send_s=LAZY_SEND_S,
                                         silent_s=self._silent_s)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def guard_writes(self, handle: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        """``handle`` for the leader: ops that change the directory are refused
        at once, before anything is applied, with ``COORDINATION_UNAVAILABLE``
        while the fencing deadline has passed (etcd unreachable, or this
        instance was frozen; a client of the group, ``etcd://``, resends them
        within its budget), else with ``NOT_ENOUGH_STANDBYS`` while fewer than
        ``sync_standbys`` standbys are in sync (:attr:`InSyncSet.short`: their
        replies could not be released; not resent: writes resume by
        themselves once a standby is back in sync). Reads go on. Refusals are
        collected in :attr:`refusals` for the loop to send at once
        (:meth:`take_refusals`)."""
        may = self.elector.may_acknowledge
        node = self
        in_sync = self.in_sync

        def guarded(payload: bytes) -> bytes:
            if may() and not in_sync.short:
                return handle(payload)
            # [op, id, args]: a fixarray of 3 whose first item is a positive fixint
            if len(payload) > 1 and payload[0] == 0x93 and payload[1] in _WRITES:
                if may():
                    code = ErrorCode.NOT_ENOUGH_STANDBYS
                    why = (f"{in_sync.count} of the {in_sync.want} standbys it needs in "
                           "sync: writes refused until one is back in sync")
                else:
                    code = ErrorCode.COORDINATION_UNAVAILABLE
                    why = "etcd unreachable (lease unconfirmed): writes refused until it returns"
                reply = encode_error(peek_id(payload), code, f"master {node.me.address}: {why}")
                node.refusals.append(reply)
                return reply
            return handle(payload)

        return guarded

    def take_refusals(self, replies: list[list[bytes]],
                      local_replies: list[Any] | None) -> tuple[list[list[bytes]], list[Any] | None,
                                                                list[list[bytes]], list[Any]]:
        """Split this iteration's replies into (held as usual, refusals to send
        now) for ZeroMQ (frames, payload last) and the direct sockets
        (``(conn, payload)`` pairs)."""
        mine = {id(b) for b in self.refusals}
        self.refusals.clear()
        zmq_now = [r for r in replies if id(r[-1]) in mine]
        local_now = [r for r in local_replies or () if id(r[1]) in mine]
        if zmq_now:
            replies = [r for r in replies if id(r[-1]) not in mine]
        if local_now and local_replies is not None:
            local_replies = [r for r in local_replies if id(r[1]) not in mine]
        return replies, local_replies, zmq_now, local_now

    def unacknowledgeable(self) -> tuple[ErrorCode, str] | None:
        """Why replies held for acks cannot be acknowledged soon (None: they
        can), as the code and message the held writes are answered with:
        ``WRITE_OUTCOME_UNKNOWN`` past the fencing deadline (a successor may
        be elected without them); ``NOT_ENOUGH_STANDBYS`` while the in-sync
        set is short of ``sync_standbys`` (:attr:`InSyncSet.short`; they were
        applied here and stay: etcd lists no standby that lacks them, so a
        successor holds them; they reach a standby before it is in sync)."""
        if not self.serving:
            return None
        if not self.elector.may_acknowledge():
            return (ErrorCode.WRITE_OUTCOME_UNKNOWN,
                    "write outcome unknown: applied at this leader but not replicated (lease "
                    "unconfirmed: etcd unreachable); it may or may not survive a failover")
        in_sync = self.in_sync
        if in_sync.short:
            return (ErrorCode.NOT_ENOUGH_STANDBYS,
                    f"applied at this leader but not acknowledged: {in_sync.count} of the "
                    f"{in_sync.want} standbys it needs in sync (it stays, and is replicated "
                    "to a standby before it is back in sync; lost only with this leader's "
                    "data dir); writes are refused until one is back in sync")
        return None

    def set_released(self, commit_no: int) -> None:
        self._released = commit_no

    def on_commit(self, records: list[DirRecord], frames: bytes, commit_no: int) -> None:
        """Frame listener: ship the group commit (``frames``: the bytes the
        journal wrote for ``records``, sent as they are) to the standbys."""
        src = self.source
        if src is None or not self.serving:
            return
        extras: list[Any] = []
        if self.keys_dirty and self.signer is not None:
            self.keys_dirty = False
            extras.append([KEYS_RECORD, self.signer.keys()])
        d = src.dir
        if d.soft_until:  # none soft-pinned: no PUT record can carry the flag
            pinned = [r.key for r in records if type(r) is Put and r.flags & SOFT_PIN]
            if pinned:
                extras.append(self._soft_pins(d, pinned))
        lsn = src.publish(records, extras, frames)
        self._pending.append((commit_no, lsn))

    def acked(self) -> int:
        """The ack gate: the highest commit number whose replies may leave."""
        lsn = self._replicated_lsn() if self.elector.may_acknowledge() else None
        if lsn is None:
            return self._released
        pending = self._pending
        while pending and pending[0][1] <= lsn:
            self._released = pending.popleft()[0]
        return self._released

    def _replicated_lsn(self) -> int | None:
        """The last position held by every in-sync member, of which there are at
        least ``sync_standbys`` (any position we wrote with 0); None when that
        many are not in sync (or there is no source)."""
        src = self.source
        if src is None:
            return None
        in_sync = self.in_sync
        if in_sync.want <= 0:
            return src.last_lsn
        if in_sync.count < in_sync.want:
            return None
        return src.acked_lsn()

    def replicated(self) -> int:
        """The highest commit number that every instance that could be elected
        holds, the fencing deadline aside: replies that acknowledge no change
        (reads, refusals) may leave up to it, since no failover can lose what
        they show. Those instances are this leader (its journal) and the
        standbys of every in-sync set etcd may hold; once this term's set is
        in etcd that is all of them, however few (none: a change held by this
        leader alone survives every failover, as only it may be elected), so
        a leader left with fewer than ``sync_standbys`` keeps answering reads.
        Before that, etcd may still list the last term's set: as acknowledgments,
        at least ``sync_standbys`` in-sync members must hold it."""
        lsn = self._replicated_lsn()
        src = self.source
        if lsn is None and src is not None and self.in_sync.confirmed is not None:
            lsn = src.acked_lsn()
        if lsn is None:
            return self._released
        out = self._released
        for commit_no, last in self._pending:
            if last > lsn:
                break
            out = commit_no
        return out

    def read_acks(self) -> bool:
        """Between two :meth:`leader_tick` calls: take what the replication
        socket holds (acks, hellos). False when the standbys changed (one
        joined or left): the caller must run :meth:`leader_tick` now, so a
        joiner is sent every key and soft pin before it can be seen holding
        everything."""
        src = self.source
        assert src is not None
        src.poll()
        return src.sessions == self._sessions_seen

    def leader_tick(self, now: float, readable: bool = True) -> bool:
        """Between loop iterations: acks, snapshots, the in-sync set. False
        when this instance no longer leads (the caller becomes a follower).
        ``readable``: the loop's poll saw the replication socket readable
        (False: skip reading it; what arrives since wakes the next poll)."""
        st = self.elector.state()
        if st.role is Role.FOLLOWER or st.epoch != self.epoch:
            return False
        src = self.source
        assert src is not None
        src.poll(readable)
        if src.sessions != self._sessions_seen:
            self._sessions_seen = src.sessions
            self._check_joined(src)
        in_sync = self.in_sync
        if self.sync_writer.busy:
            in_sync.written(src)
        if now >= self._next_sync_check and st.role is Role.LEADER:
            self._next_sync_check = now + 0.02
            in_sync.maintain(src)
        in_sync.track(now, src.connected())
        return True

    def _check_joined(self, src: ReplicationSource) -> None:
        """The standbys changed (a hello, one forgotten): joiners get every
        capability key and soft pin; in-sync flags are set again."""
        standbys = src.standbys
        seen = self._standbys_seen
        joined = [k for k, v in standbys.items() if seen.get(k) is not v]
        if joined or len(standbys) != len(seen):
            if joined:  # joiners (a restarted one too) need every key and soft pin
                recs = [self._soft_pins(src.dir, list(src.dir.soft_until))] \
                    if src.dir.soft_until else []
                if self.signer is not None:
                    recs.append([KEYS_RECORD, self.signer.keys()])
                src.publish([], recs)
            self._standbys_seen = dict(standbys)
            self.in_sync.flag(src)

    def demote(self, directory: Directory) -> ReplicaSink:
        """Deposed: stop serving, follow whoever leads (keeping our position)."""
        self.serving = False
        self.demotions += 1
        if self.source is not None:
            self.source.close()
            self.source = None
        self._pending.clear()
        directory.journaling = False
        log.warning("%s: deposed from epoch %d; following", self.me.instance_id, self.epoch)
        return self.begin_follower(directory)

    # ================================================================ health
    def stats(self) -> HaStats:
        """A copy of this instance's HA state (any thread; the caller retries
        if the loop changed a container under it: ``copy_retrying``). A
        leader reads ``fenced`` from the moment its fencing deadline passes."""
        st = self.elector.state()
        leader = st.leader
        serving = self.serving
        role = "leader" if serving and st.role is Role.LEADER else "follower"
        src = self.source
        acked_lsn = in_sync = None
        standbys: tuple[HaStandbyStats, ...] = ()
        if src is not None and serving:
            last = src.last_lsn
            acked_lsn = src.acked_lsn()
            in_sync = self.in_sync.count
            standbys = tuple(
                HaStandbyStats(s.instance_id, s.state.value, s.in_sync, s.acked_lsn, s.lag(last))
                for s in src.status())
        sink = self.sink
        return HaStats(
            role=role, election=st.role.value, epoch=st.epoch,
            instance_id=self.me.instance_id, eligible=st.eligible,
            leader=leader.address if leader is not None else None, lsn=self.log.last_lsn,
            fenced=serving and st.role is Role.FENCED,
            # role, fenced and writes_refused from one state: past the deadline
            # state() says FENCED, by the clock check may_acknowledge() makes
            writes_refused=serving and (st.role is not Role.LEADER or self.in_sync.short),
            promotions=self.promotions,
            demotions=self.demotions, acked_lsn=acked_lsn, in_sync=in_sync, standbys=standbys,
            sink=sink.state.value if sink is not None else None,
            applied_lsn=sink.log.last_lsn if sink is not None else None)

    def health(self) -> dict[str, Any]:
        """The ``/health`` fields of :meth:`stats` (leader-only and
        follower-only ones only where they apply)."""
        s = self.stats()
        out: dict[str, Any] = {
            "role": s.role, "election": s.election, "epoch": s.epoch,
            "instance_id": s.instance_id, "eligible": s.eligible, "leader": s.leader,
            "lsn": s.lsn, "fenced": s.fenced, "writes_refused": s.writes_refused,
        }
        if s.acked_lsn is not None:
            out["acked_lsn"] = s.acked_lsn
            out["in_sync"] = s.in_sync
            out["standbys"] = [
                {"instance_id": b.instance_id, "state": b.state, "in_sync": b.in_sync,
                 "acked_lsn": b.acked_lsn, "lag": b.lag} for b in s.standbys]
        if s.sink is not None:
            out["sink"] = s.sink
            out["applied_lsn"] = s.applied_lsn
        return out
