"""The master process: one event loop on a ZeroMQ ROUTER socket.

Rooms: the op handlers (:mod:`kvpool.master.handlers`, socket-free), the
durability room (:mod:`kvpool.master.durability`: journal, snapshots,
restore, capability keys), the counters (:mod:`kvpool.master.stats`) and
this loop, which owns the sockets and the timers.

Each loop iteration drains up to ``_DRAIN`` requests from the ROUTER socket
and the same-host Unix socket, runs them through the handlers, group-commits
the directory records they produced (one write, fsync per policy, then the
commit listeners), and only then sends the replies. Timers (client expiry,
purge of dropped segments, pending-put sweep, journal fsync, snapshot
slices) run between iterations in bounded slices so the loop never stalls.
"""

from __future__ import annotations

import collections
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from kvpool.core import __version__
from kvpool.core import spin as spin_mod
from kvpool.core.capability import CapabilitySigner
from kvpool.core.errors import ErrorCode
from kvpool.core.http import HttpEndpoints
from kvpool.core.protocol import decode_reply, encode_error
from kvpool.master.config import MasterConfig
from kvpool.master.directory import Directory
from kvpool.master.durability import Durability
from kvpool.master.events import EventPublisher
from kvpool.master.ha.node import HaNode
from kvpool.master.handlers import OpHandlers, ServerInfo
from kvpool.master.local_rpc import LocalRpcServer, default_socket_path
from kvpool.master.parked import ParkedPings
from kvpool.master.poller import LoopPoller
from kvpool.master.stats import MasterStats, copy_retrying
from kvpool.master.tiering import TieringPolicy

__all__ = ["MasterServer"]

log = logging.getLogger(__name__)

_DRAIN = 256
_HELD_POLL_MS = 5  # poll timeout while replies wait for acks
_LAZY_POLL_MS = 10  # ... while batches for lazy standbys are held back (lazy_send_s)
_FULL_TURN_S = 0.002  # a turn woken by acks alone within this of a full one only reads them
_EMPTY = b""
# plain ints: IntFlag arithmetic costs ~1 µs per operation on the hot path
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)


class MasterServer:
    """Serve the op table of :mod:`kvpool.core.protocol` until ``stop()``.

    Construction restores state from ``data_dir`` and binds the sockets
    (``port`` 0 picks a free one; see ``self.port``).
    """

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.tiering = TieringPolicy(cfg.tiering)
        self.info = ServerInfo()
        #: PINGs held until a tier task for their node is queued (a long poll)
        self.parked = self.info.parked = ParkedPings()
        self.tiering.book.on_queued = self.parked.release  # a task wakes its node's PING
        self.durability = Durability(cfg, self.info.loop)
        self._stop = False
        self.signer: CapabilitySigner | None = None
        self._poller = LoopPoller()  # the loop's (serve_forever)
        if cfg.capabilities:
            self.signer = CapabilitySigner(cfg.capability_ttl_ms or cfg.lease_ttl_ms)
        # The directory is millions of long-lived, cycle-free objects: full GC
        # passes over them would stall the loop for 100s of ms. Collect young
        # objects rarely and freeze survivors (frozen objects are still freed
        # by refcounting; they are just never scanned).
        gc.set_threshold(50000, 50, 1000)
        gc.disable()
        try:
            self.dir: Directory = self.durability.restore(
                lambda: Directory(cfg, hooks=self.tiering))
            self.durability.load_keys(self.signer, self.dir.segments)
        finally:
            gc.enable()
        gc.freeze()
        self.handlers = OpHandlers(cfg, self.dir, self.tiering, self.signer, self.info)
        #: payload -> reply: the handlers (an HA leader wraps them: fenced -> no writes)
        self._payload: Callable[[bytes], bytes] = self.handlers.handle_payload
        self.info.save_keys = lambda: self.durability.save_keys(self.signer)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # frames up to max_frame_size get a FRAME_TOO_LARGE reply from the decoder;
        # far larger ones make ZeroMQ drop the connection before buffering them
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * cfg.max_frame_size + 4096)
        # back-pressure: a connection's queue is bounded; beyond it ZeroMQ stops
        # reading that peer's TCP stream (see max_inflight_per_client)
        self.sock.setsockopt(zmq.RCVHWM, 4 * cfg.max_inflight_per_client)
        self.sock.setsockopt(zmq.SNDHWM, 100000)
        # CURVE (+ ZAP allow-list) before bind; None when off (loopback default)
        self._auth = cfg.curve.setup_server(self.sock, cfg.host)
        self.info.curve = self._auth is not None
        self.info.curve_denied = lambda: self._auth.denied if self._auth is not None else 0
        if cfg.port == 0:
            self.port = self.sock.bind_to_random_port(f"tcp://{cfg.host}")
        else:
            self.sock.bind(f"tcp://{cfg.host}:{cfg.port}")
            self.port = cfg.port
        # direct RPC sockets served from the loop (local_rpc): a Unix socket for
        # same-host clients, a raw TCP port for the others; never beside CURVE
        # (they would bypass it), except an explicitly configured socket path
        self.local_rpc: LocalRpcServer | None = None
        local = cfg.local_socket
        if local == "auto":
            local = "off" if self._auth is not None else default_socket_path(self.port)
        path = local if local and local != "off" else None
        tcp_host = cfg.host if cfg.rpc_tcp and self._auth is None else None
        if path:
            try:
                self.local_rpc = LocalRpcServer(path, cfg.max_frame_size, tcp_host)
            except OSError as exc:
                log.warning("no local socket at %s (%s); same-host clients use tcp", path, exc)
        if self.local_rpc is None and tcp_host:
            try:
                self.local_rpc = LocalRpcServer(None, cfg.max_frame_size, tcp_host)
            except OSError as exc:
                log.warning("no direct RPC port on %s (%s); clients use ZeroMQ", tcp_host, exc)
        lr = self.local_rpc
        if lr is not None:
            self.info.local_endpoint = lambda: (lr.path, lr.instance, lr.tcp_port)
            self.info.local_counts = lambda: (lr.requests, lr.connections)
        # object events (docs/events.md); HA sets ``self.events.term`` (epoch, or
        # None while this master is not the serving leader)
        self.events: EventPublisher | None = None
        if cfg.events_port:
            self.events = EventPublisher(cfg, self.ctx, self.dir)
            self.durability.add_listener(self.events.on_commit)
            self.info.events_position = self.events.position
        self._http: HttpEndpoints | None = None
        self.metrics_port = 0
        if cfg.metrics_port:
            self._start_http()
        # HA (docs/ha.md): one instance of a group elected through etcd
        self.ha: HaNode | None = None
        if cfg.etcd:
            self._setup_ha()
        log.info("kvpool master %s listening on tcp://%s:%d (CURVE %s, metrics %s, data_dir %s)",
                 __version__, cfg.host, self.port, "on" if self._auth else "off",
                 self.metrics_port or "off", cfg.data_dir)

    # ================================================================ readers
    def stats_snapshot(self) -> MasterStats:
        """A copy of every counter (safe from any thread)."""
        h = self.handlers
        c = h.counters
        ha = self.ha

        def take() -> MasterStats:
            return MasterStats(h.admin.stats(), h.segments.list_segments().segments, dict(c.ops),
                               dict(c.key_ops), dict(c.errors), self.port,
                               self.events.stats() if self.events is not None else {},
                               ha.stats() if ha is not None else None,
                               self.dir.tenants.rows(len(self.dir.objects)))

        return copy_retrying(take)

    def health(self) -> dict[str, Any]:
        """``/health``: liveness and a few counters."""
        out: dict[str, Any] = {
            "status": "ok", "version": __version__, "port": self.port,
            "objects": len(self.dir.objects), "segments": len(self.dir.segments),
            "uptime_s": round(time.monotonic() - self.info.started, 3)}
        ha = self.ha
        if ha is not None:
            out.update(ha.health())
            sink = ha.sink
            if sink is not None:  # a follower: the replicated directory
                out["objects"] = len(sink.directory.objects)
                out["segments"] = len(sink.directory.segments)
        return out

    # ================================================================ HA
    def _setup_ha(self) -> None:
        cfg = self.cfg
        self.ha = ha = HaNode(cfg, self.port, self.metrics_port, self.signer,
                              lambda: Directory(cfg, hooks=self.tiering), self.ctx)
        self.durability.add_frame_listener(ha.on_commit)
        save = self.info.save_keys

        def save_keys() -> None:
            ha.keys_dirty = True
            save()

        self.info.save_keys = save_keys
        if self.events is not None:
            self.events.term = lambda: ha.epoch if ha.serving else None
        if cfg.data_dir:
            ha.store = self.durability

            def save_stream_keys() -> None:
                try:
                    self.durability.save_keys(self.signer)
                except OSError as exc:
                    log.error("cannot write capability keys: %s", exc)

            ha.on_keys = save_stream_keys
        position = self.durability.position
        if position is not None:  # the data dir holds a replicated state: go on from it
            log.info("HA: following from the replicated state of the data dir (lsn %d, "
                     "epoch %d)", position.lsn, position.epoch)
            ha.begin_follower(self.dir, position)
        else:
            ha.begin_follower(None)
        ha.start()
        log.info("HA instance %s of group %s (etcd %s, replication %s, sync_standbys %d)",
                 ha.me.instance_id, cfg.cluster_id, cfg.etcd, ha.me.replication,
                 cfg.sync_standbys)

    def _promote(self) -> None:
        """Elected: serve the replicated directory (or the restored one)."""
        ha = self.ha
        assert ha is not None
        from_stream = ha.streamed or (ha.sink is not None and ha.sink.log.last_lsn > 0)
        journaled = ha.sink is not None and ha.sink.based
        d = ha.promote(self.dir)
        self.dir = d
        if self.signer is not None:
            # every token of this term carries its epoch: node daemons that
            # see it refuse the grants of earlier terms (docs/ha.md, fencing)
            self.signer.epoch = ha.epoch
        self.handlers = OpHandlers(self.cfg, d, self.tiering, self.signer, self.info)
        self._payload = ha.guard_writes(self.handlers.handle_payload)
        if self.events is not None:
            self.events.rebind_directory(d)
        self.durability.set_ack_gate(ha.acked, ha.replicated)
        ha.set_released(self.durability.commits)
        if self.signer is not None:
            try:
                self.durability.save_keys(self.signer)
            except OSError as exc:
                log.error("cannot write capability keys: %s", exc)
        if from_stream and not journaled:
            # the data dir does not hold the replicated state (no data dir, or
            # it could not be written): a snapshot of the promoted directory
            self.durability.request_snapshot()
        log.info("serving as the leader of epoch %d", ha.epoch)

    def _serve_follower(self, poller: LoopPoller) -> bool:
        """Replicate the leader, refuse client calls; True once elected."""
        ha = self.ha
        assert ha is not None
        sock = self.sock
        recv = sock.recv_multipart
        local = self.local_rpc
        limit = self.cfg.max_inflight_per_client
        refuse = ha.not_leader_reply
        sink_sock: Any = None
        next_freeze = time.monotonic()
        try:
            while not self._stop:
                if ha.follower_tick():
                    return True
                sink = ha.sink
                assert sink is not None
                if sink.pollable != sink_sock:  # a socket, or a file descriptor
                    if sink_sock is not None:
                        poller.unregister(sink_sock)
                    sink_sock = sink.pollable
                    if sink_sock is not None:
                        poller.register(sink_sock, zmq.POLLIN)
                # messages read and not taken yet: no poll reports them
                loading = sink.directory.objects.unloaded is not None
                events = poller.poll(0 if sink.backlogged or loading else 20)
                if events:
                    # the ROUTER socket, registered first, is first when it has messages
                    if events[0][0] is sock:
                        poller.touch(sock)
                    for _ in range(_DRAIN if events[0][0] is sock else 0):
                        if not cast(int, sock.get(_EVENTS)) & _POLLIN:
                            break
                        frames = recv(_NOBLOCK, copy=True)
                        if len(frames) >= 2:
                            prefix = frames[:2] if len(frames) == 3 and frames[1] == _EMPTY \
                                else frames[:1]
                            self._send([[*prefix, refuse(frames[-1])]], None)
                    if local is not None:
                        out = local.serve(events, refuse, refuse, limit)
                        if out:
                            local.send_all(out)
                # the poll above looked at the stream already: no second look
                sink.poll(0, ready=bool(events) and sink_sock is not None
                          and any(e[0] == sink_sock for e in events))
                if loading:
                    sink.directory.objects.load_step(self.cfg.restore_slice_ms / 1000.0)
                now = time.monotonic()
                if sink.based:  # fsync per policy, snapshots of the journaled stream
                    self.durability.tick(sink.directory, now, sink.position)
                if now >= next_freeze:  # as the leader: the replicated objects are not rescanned
                    next_freeze = now + 1.0
                    gc.freeze()
            return False
        finally:
            if sink_sock is not None:
                poller.unregister(sink_sock)

    def request_snapshot(self) -> None:
        """Take a snapshot at the next loop iteration (also SIGUSR1)."""
        self.durability.request_snapshot()

    # ================================================================ admin HTTP
    def _start_http(self) -> None:
        from kvpool.master.metrics import make_registry, make_routes

        self._http = HttpEndpoints(make_routes(self, make_registry(self)), self.cfg.metrics_host,
                                   self.cfg.metrics_port, "kvpool-master-http")
        self.metrics_port = self._http.port

    # ================================================================ loop
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop after the current iteration; SIGUSR1: snapshot."""
        def _stop(signum: int, _frame: Any) -> None:
            log.info("signal %d: shutting down", signum)
            self._stop = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGUSR1, lambda *_: self.request_snapshot())

    def stop(self) -> None:
        self._stop = True

    def _recv_identified(self, flags: int, copy: bool = True) -> list[bytes]:
        """``sock.recv_multipart`` that also sets ``info.peer`` to the
        sender's CURVE public key (ZeroMQ's ``User-Id`` metadata: the z85
        key the ZAP handler authenticated), for ``tenant_keys``."""
        frames = self.sock.recv_multipart(flags, copy=False)
        try:
            peer = frames[-1].get("User-Id")
        except zmq.ZMQError:  # no such metadata (no CURVE on this connection)
            peer = None
        self.info.peer = peer if isinstance(peer, str) else None
        return [f.bytes for f in frames]

    def handle_frames(self, frames: list[bytes]) -> list[bytes] | None:
        """One ROUTER message -> the reply frames (None: nothing to answer)."""
        n = len(frames)
        if n == 2:  # DEALER: [identity, payload]
            prefix = frames[:1]
        elif n == 3 and frames[1] == _EMPTY:  # REQ: [identity, "", payload]
            prefix = frames[:2]
        elif n >= 2:
            self.handlers.counters.error("invalid", ErrorCode.MALFORMED_FRAME.name)
            return [frames[0], encode_error(None, ErrorCode.MALFORMED_FRAME,
                                            f"expected one payload frame, got {n - 1}")]
        else:
            return None
        return [*prefix, self._payload(frames[-1])]

    def _too_many(self, frames: list[bytes]) -> list[bytes] | None:
        if len(frames) < 2:
            return None
        prefix = frames[:2] if len(frames) == 3 and frames[1] == _EMPTY else frames[:1]
        return [*prefix, self.handlers.too_many(frames[-1])]

    def serve_forever(self) -> None:
        # the ROUTER socket lazy: every recv/send on it is followed by touch()
        # (in the drains and _send), so an idle ROUTER costs no EVENTS queries
        self._poller = poller = LoopPoller()
        poller.register(self.sock, zmq.POLLIN, lazy=True)
        if self.local_rpc is not None:
            self.local_rpc.register(poller)
        ha = self.ha
        if ha is None:
            self._serve(poller)
            return
        while not self._stop:
            if not self._serve_follower(poller):
                return
            self._promote()
            assert ha.source is not None
            repl = ha.source.pollable
            poller.register(repl, zmq.POLLIN)
            try:
                self._serve(poller)
            finally:
                poller.unregister(repl)
            if self._stop:
                return
            self.durability.set_ack_gate(None)
            ha.demote(self.dir)

    def _serve(self, poller: LoopPoller) -> None:
        """The serving loop (a single master, or the elected leader until deposed)."""
        sock = self.sock
        # tenant_keys: each request runs knowing its connection's CURVE key
        identify = bool(self.cfg.tenant_keys)
        recv = self._recv_identified if identify else sock.recv_multipart
        handle = self.handle_frames
        handlers = self.handlers
        inflight_limit = self.cfg.max_inflight_per_client
        durability = self.durability
        commit = durability.commit
        d = self.dir
        records = d.records
        loop_stats = self.info.loop
        local = self.local_rpc
        publisher = self.events
        ha = self.ha
        parked = self.parked
        parked.drop()  # (a new term: nothing held from an earlier one)
        # replies waiting for the ack gate (durability.set_ack_gate), oldest first:
        # (commit number, whether the iteration changed anything, replies, local)
        held: collections.deque[tuple[int, bool, list[list[bytes]], Any]] = collections.deque()
        next_expiry = next_sweep = next_freeze = time.monotonic()
        # polling without sleeping after an answer (cfg.rpc_spin_us), unless a
        # late yield showed a busy CPU (kvpool.core.spin): at most the window's
        # CPU per answered round. No gate on how soon the next request came of
        # late: on a host whose idle CPUs halt, the poll pays by keeping this CPU
        # awake for the wake-ups of the client's next leg (a put's write to a
        # node) as much as by catching the client's next request
        spin = self.cfg.rpc_spin_us / 1e6
        spin_end = 0.0  # poll without sleeping until then (0: sleep at once)
        clock = time.perf_counter
        # a fenced HA leader acknowledges nothing, so a timer's change (expiry,
        # purge, eviction, sweep, tier moves) would diverge from what a
        # successor holds: those timers wait until the lease is confirmed again
        unfenced: Callable[[], bool] = ha.elector.may_acknowledge if ha is not None \
            else lambda: True
        # acks are read only when the poll saw them (a zmq_poll per look otherwise);
        # a ZeroMQ socket or a file descriptor (the poller reports an fd as an int)
        source = ha.source if ha is not None else None
        repl_sock = source.pollable if source is not None else None
        # a turn woken by acks alone, shortly after a full turn, only reads them
        # and releases replies: timers and the HA upkeep wait (at most
        # _FULL_TURN_S; nothing is acknowledged past what acked() allows)
        next_full = 0.0
        restore_slice = self.cfg.restore_slice_ms / 1000.0
        while not self._stop:
            timers = unfenced()
            # held PINGs to answer this turn: a task for their node came (or their wait ended)
            now = time.monotonic()
            wake = parked.due(now) if parked.ready(now) else None
            # held replies wait for acks, which wake the poll; the timeout only
            # bounds how late a fencing deadline or a change of the in-sync set
            # is seen while they wait
            timeout = 0 if (timers and (d.objects.purge_pending or d.evictor.evicting)) \
                or durability.busy or wake or d.objects.unloaded is not None \
                else _HELD_POLL_MS if held \
                else _LAZY_POLL_MS if source is not None and source.lazy_due else 50
            events = None
            if spin_end and timeout:
                while True:
                    events = poller.poll(0)
                    # a client or a node may be waiting for this CPU; a late yield
                    # (a busy CPU, which does not halt anyway) ends the poll
                    if events or clock() >= spin_end or not spin_mod.yield_cpu():
                        break
                spin_end = 0.0
            if not events:
                events = poller.poll(timeout)
            # acks alone (the replication socket the only one readable): no request
            requests = bool(events) and (events[0][0] != repl_sock or len(events) > 1)
            if requests or wake:
                t_start = clock()
                commits_before = durability.commits
                replies: list[list[bytes]] = []
                per_peer: dict[bytes, int] = {}
                for frames, peer in wake or ():  # answered now, as requests of this turn
                    if identify:
                        self.info.peer = peer
                    out = handle(frames)
                    if out is not None:
                        replies.append(out)
                from_sock = bool(events) and events[0][0] is sock
                if from_sock:
                    poller.touch(sock)  # a drain cut at _DRAIN leaves messages
                # the ROUTER socket, registered first, is first in ``events`` when
                # it has messages: a round with direct-socket requests only skips
                # its EVENTS check (a poll(2) and a getpid(2) inside ZeroMQ)
                parked.allowed = True  # a PING of this drain may be held
                for _ in range(_DRAIN if from_sock else 0):
                    # check EVENTS rather than catching zmq.Again (exceptions are slow)
                    if not cast(int, sock.get(_EVENTS)) & _POLLIN:
                        break
                    frames = recv(_NOBLOCK, copy=True)
                    ident = frames[0]
                    queued = per_peer.get(ident, 0) + 1
                    per_peer[ident] = queued
                    out = handle(frames) if queued <= inflight_limit else self._too_many(frames)
                    if parked.asked is not None:  # (an attribute test per request)
                        parked.hold(frames, self.info.peer)
                        continue  # held: answered by a later turn
                    if out is not None:
                        replies.append(out)
                parked.allowed = False
                if identify:
                    self.info.peer = None  # the same-host socket: no key, default only
                local_replies = local.serve(events, self._payload,
                                            handlers.too_many, inflight_limit) \
                    if local is not None and events else None
                if ha is not None and ha.refusals:  # they reveal nothing: not held
                    replies, local_replies, now_z, now_l = ha.take_refusals(replies,
                                                                            local_replies)
                    self._send(now_z, now_l)
                commit_no = commit(records)  # group commit before any reply leaves
                if durability.gated:
                    held.append((commit_no, commit_no != commits_before, replies,
                                 local_replies))
                else:
                    self._send(replies, local_replies)
                answered = clock()
                if spin and spin_mod.polling():
                    spin_end = answered + spin
                loop_ms = (answered - t_start) * 1000
                if loop_ms > loop_stats.max_loop_ms:
                    loop_stats.max_loop_ms = loop_ms
            now = time.monotonic()
            if ha is not None and source is not None and events and not requests \
                    and now < next_full and ha.read_acks():
                if held:
                    self._release_acked(held, durability.acked())
                if publisher is not None:
                    publisher.flush(durability.acked(), now)
                continue
            next_full = now + _FULL_TURN_S
            if d.objects.unloaded is not None:  # (no change of state: fenced or not)
                d.objects.load_step(restore_slice)
            if unfenced():
                if d.objects.purge_pending:
                    d.purge_step(self.cfg.purge_slice)
                if d.evictor.evicting:
                    d.evictor.step()
                if now >= next_expiry:
                    next_expiry = now + 0.1
                    d.liveness.expire_step()
                    self.tiering.tick(d)  # tier task deadlines, kept file segments
                if now >= next_sweep:
                    next_sweep = now + 1.0
                    d.writes.sweep()
                    durability.prune_keys(self.signer, d.segments)
            if now >= next_freeze:
                next_freeze = now + 1.0
                gc.freeze()  # O(1): moves survivors out of the scanned generations
            commit(records)  # expiry/sweep changes
            durability.tick(d, now)
            if ha is not None and not ha.leader_tick(
                    now, bool(events) and any(e[0] == repl_sock for e in events)):
                log.warning("no longer the leader: %d held replies dropped (never "
                            "acknowledged), %d held PINGs unanswered", len(held), parked.drop())
                return
            if held:
                acked = durability.acked()
                self._release_acked(held, acked)
                if held:
                    # an HA leader's replicated() passes acked() only while it may
                    # not acknowledge (fenced, or short of in-sync standbys): looked
                    # at only then, not per ack wait
                    why = ha.unacknowledgeable() if ha is not None else None
                    if ha is None or why is not None:
                        replicated = durability.replicated()
                        if replicated > acked:
                            self._release_unchanged(held, replicated)
                    if why is not None:
                        self._fail_unacknowledged(held, why)
            if publisher is not None:  # after the replies: one batch per loop turn
                publisher.flush(durability.acked(), now)

    def _release_acked(self, held: collections.deque[tuple[int, bool, list[list[bytes]], Any]],
                       acked: int) -> None:
        """Send the held replies, oldest first, of every iteration up to commit
        ``acked`` (the ack gate's position)."""
        while held and held[0][0] <= acked:
            _no, _wrote, replies, local_replies = held.popleft()
            self._send(replies, local_replies)

    def _release_unchanged(self, held: collections.deque[tuple[int, bool, list[list[bytes]],
                                                               Any]], replicated: int) -> None:
        """Send the held replies of iterations that changed nothing once what they
        show is replicated; acknowledgments of changes stay held (in order).
        Reached only while acknowledgments lag replication: an HA leader past its
        fencing deadline, or short of in-sync standbys (it must still answer
        reads and refuse writes)."""
        keep = [h for h in held if h[1] or h[0] > replicated]
        if len(keep) == len(held):
            return
        for no, wrote, replies, local_replies in held:
            if not wrote and no <= replicated:
                self._send(replies, local_replies)
        held.clear()
        held.extend(keep)

    def _fail_unacknowledged(self, held: collections.deque[tuple[int, bool, list[list[bytes]],
                                                                  Any]],
                             why: tuple[ErrorCode, str]) -> None:
        """An HA leader that cannot acknowledge (``why``: the code and message of
        ``HaNode.unacknowledgeable``): answer the held replies of iterations
        that changed the directory with that code now instead of letting
        their callers time out. Those changes were applied here but not
        replicated: fenced, a successor may or may not hold them
        (``WRITE_OUTCOME_UNKNOWN``, taken as a timeout); short of in-sync
        standbys, they stay (``NOT_ENOUGH_STANDBYS``). Replies of iterations
        that changed nothing stay held (they may show such a change; they
        leave once every instance that could be elected holds it, or their
        callers time out)."""
        keep = [h for h in held if not h[1]]
        if len(keep) == len(held):
            return
        code, msg = why

        def failed(payload: bytes) -> bytes:
            try:
                rid = decode_reply(payload).id
            except Exception:
                rid = None
            return encode_error(rid, code, msg)

        n = 0
        for _no, wrote, replies, local_replies in held:
            if wrote:
                n += len(replies) + len(local_replies or ())
                self._send([[*r[:-1], failed(r[-1])] for r in replies],
                           [(conn, failed(p)) for conn, p in local_replies or ()])
        held.clear()
        held.extend(keep)
        log.warning("%d held replies of unreplicated changes answered %s (%s)", n,
                    code.name, msg)

    def _send(self, replies: list[list[bytes]], local_replies: Any) -> None:
        if replies:
            self._poller.touch(self.sock)  # a send may take the mailbox's signal
        send = self.sock.send_multipart
        for r in replies:
            try:
                send(r, _NOBLOCK)
            except zmq.ZMQError:
                pass  # peer gone / HWM: the client times out and retries
        if local_replies:
            self.local_rpc.send_all(local_replies)  # type: ignore[union-attr]

    def close(self) -> None:
        """Flush + fsync the journal, stop a snapshot in progress, close sockets;
        an HA instance resigns (a successor is elected at once)."""
        if self.ha is not None:
            self.ha.close()
        self.durability.close(self.dir.records)
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.local_rpc is not None:
            self.local_rpc.close()
            self.local_rpc = None
        if self.events is not None:
            self.events.close()
            self.events = None
        self.sock.close(0)
        if self._auth is not None:
            self._auth.close()
            self._auth = None
        self.ctx.term()
        log.info("master stopped")
