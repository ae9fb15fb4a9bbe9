"""The guard: a small process per segment-owning client that keeps its lease
and releases its memory when it dies.

A client process may stall for a long time while its memory is perfectly
alive: a long call that holds the GIL, a debugger, SIGSTOP. Its own ping
thread cannot run then, so liveness cannot depend on it. And a process may
die without running any cleanup: SIGTERM's default action, kill -9, a crash.
The guard (``python -m kvpool.store.guard``, spawned by the client's
:class:`kvpool.store.segment_host.SegmentHost`) covers both:

- **heartbeats**: every ``interval_s`` it sends ``Ping(client_id,
  heartbeat=True)`` to the master, from its own process, whatever the
  parent is doing. The master then never drops the client's segments while
  the guard beats (it only marks them suspect when the client's own pings
  stop: no new placements);
- **watching the parent**: a pidfd (Linux >= 5.3; else polling getppid())
  tells it the moment the parent exits, however it exits. It then unlinks
  the parent's ``/dev/shm`` segments (memory freed, not lost until reboot)
  and unmounts them at the master (their objects leave the pool at once
  instead of after the master's grace period). File segments (the SSD tier)
  are left for a warm restart, as ``close()`` leaves them.

Protocol on the guard's stdin (a socket) and stdout: JSON lines, each a
message tagged by its ``op`` field (:data:`GuardMessage`): ``spec`` (the
:class:`GuardSpec`), answered ``ready`` on stdout once the guard watches the
parent, and ``close`` (:class:`GuardClose`: the parent has released
everything itself, or never got as far as sending the spec). A close, or EOF
while the parent lives, ends the guard quietly, whether or not a spec came
first; a line that is not such a message (or a second spec) is logged at
warning and skipped.
It ignores SIGINT and SIGTERM (it runs in its own session, so a terminal's
Ctrl-C or a process-group kill reaches only the parent): it outlives the
parent by design, for as long as the cleanup takes, then exits.

Its cost (``scripts/bench_lifecycle.py``, docs/BENCHMARKS.md): an
interpreter start, off the client's setup path (setup does not wait for its
answer); the memory of Python and pyzmq; one PING per ``ping_interval_s``;
after kill -9 of its parent the shm file is gone and the segment unmounted
within milliseconds.

Not covered: the guard killed together with its parent (kill -9 of both, a
cgroup OOM kill): every segment-owning process on the host removes such
orphans at setup and the node daemon does periodically
(:func:`kvpool.transfer.segment.reap_orphaned_shm`, owner liveness by flock).
A frozen cgroup freezes the guard too: the master's ``client_grace_s``
covers that.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from kvpool.core.auth import CurveConfig
    from kvpool.core.rpc_client import MasterClient, RpcPollConfig

__all__ = ["Guard", "GuardClose", "GuardMessage", "GuardSpec", "master_stub"]

log = logging.getLogger(__name__)

_READY = b"ready\n"
_UNMOUNT_RETRY_S = 30.0  # how long a dead parent's unmounts are retried (master away)


def master_stub(address: str, timeout_s: float, curve: CurveConfig,
                poll: RpcPollConfig | None = None, local: str = "auto") -> MasterClient:
    """A master RPC stub; with CURVE when the policy makes it active for the
    master's address (off for loopback unless forced, on otherwise).
    ``poll``: its reply poll (None: the defaults); ``local``: "off" keeps it
    on ZeroMQ on the master's host too."""
    from kvpool.core.etcd import policy_address
    from kvpool.core.rpc_client import MasterClient

    addr = policy_address(address)
    addr = addr if "://" in addr else f"tcp://{addr}"
    if not curve.active(addr):
        return MasterClient(address, timeout_s=timeout_s, poll=poll, local=local)
    kp = curve.keypair()
    return MasterClient(address, timeout_s=timeout_s,
                        curve_server_key=curve.server_public_key(),
                        curve_keypair=(kp.public, kp.secret), poll=poll, local=local)


class GuardSpec(msgspec.Struct, tag_field="op", tag="spec", kw_only=True):
    """What the guard needs: the ``spec`` message (one JSON line)."""

    parent_pid: int
    client_id: str
    master_address: str
    rpc_timeout_s: float
    interval_s: float
    # memory segments: segment id -> /dev/shm name
    shm: dict[str, str] = {}
    curve: dict[str, Any] = {}  # CurveConfig fields
    curve_active: bool = False  # False: the guard need not import CURVE support
    log_level: int = logging.WARNING


class GuardClose(msgspec.Struct, tag_field="op", tag="close"):
    """The ``close`` message: the parent released everything itself (or has
    nothing for the guard to guard); the guard exits quietly."""


#: every line the parent writes is one of these, told apart by ``op``
GuardMessage = GuardSpec | GuardClose
_CLOSE = msgspec.json.encode(GuardClose()) + b"\n"
_MAX_LINE = 1 << 20  # a longer line is not a message (skipped, with a warning)


class Guard:
    """Parent side: one guard process (module docstring).

    :meth:`spawn` starts the interpreter early (its start-up overlaps the
    caller's segment creation); :meth:`start` sends the spec; :meth:`ready`
    tells whether it answered; :meth:`close` ends it after the parent
    released everything.
    """

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self._sock = sock  # the guard's stdin: a socket, so a write never raises SIGPIPE
        self.spawned_at = time.monotonic()
        self.ready_s = 0.0  # spawn -> ready (0 until it answered)
        self._answer = b""

    @classmethod
    def spawn(cls, stderr: int | IO[Any] | None = None) -> Guard:
        """Start a guard process (it waits for :meth:`start`'s spec). Its
        stderr, where it logs, is ours unless ``stderr`` names another."""
        # stdin is a socket pair rather than a pipe: the parent writes with
        # MSG_NOSIGNAL, so a guard that died can never kill an application
        # that restored SIGPIPE's default action
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool.store.guard"],
                stdin=theirs.fileno(), stdout=subprocess.PIPE, stderr=stderr,
                close_fds=True,  # no segment lock fd, no other pipe end leaks in
                start_new_session=True,  # Ctrl-C / killpg of the parent's group spare it
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data, socket.MSG_NOSIGNAL)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, spec: GuardSpec) -> None:
        """Send ``spec`` (a pipe write; no waiting: the guard watches the parent
        from its first instruction on, so nothing is lost before it answers).
        Raises OSError when the guard is already gone."""
        self._send(msgspec.json.encode(spec) + b"\n")

    @property
    def is_ready(self) -> bool:
        return self.ready_s > 0.0

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the guard has answered ``ready`` (waiting up to ``timeout_s``).
        Raises OSError when it exited or answered something else."""
        if self.is_ready:
            return True
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while not self._answer.endswith(b"\n"):
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                return False
            chunk = os.read(fd, 64)
            if not chunk:
                raise OSError(f"guard {self.pid} exited ({self.proc.poll()})")
            self._answer += chunk
        if self._answer != _READY:
            raise OSError(f"guard {self.pid} answered {self._answer!r}")
        self.ready_s = time.monotonic() - self.spawned_at
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Tell the guard the parent released everything itself; reap it."""
        proc = self.proc
        with contextlib.suppress(OSError):
            self._send(_CLOSE)
        self._sock.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


# ---------------------------------------------------------------------- the guard process


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid`` (readable once it exits), or -1 where unsupported."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


class _Messages:
    """The parent's messages on ``fd``: each complete line decoded as a
    :data:`GuardMessage`; a line that is not one is logged at warning and
    dropped (no line ever ends the guard)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self._buf = b""
        self._ready: collections.deque[GuardMessage] = collections.deque()
        self._decode = msgspec.json.Decoder(GuardMessage).decode

    def read(self) -> bool:
        """Read what is there (blocking until something is) and decode its
        complete lines; False at EOF."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.eof = True
            return False
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        if len(self._buf) > _MAX_LINE:
            log.warning("guard: a line longer than %d bytes skipped", _MAX_LINE)
            self._buf = b""
        for line in lines:
            if not line.strip():
                continue
            try:
                self._ready.append(self._decode(line))
            except msgspec.DecodeError as exc:  # not JSON, unknown op, wrong field types
                log.warning("guard: line skipped (%s): %r", exc, line[:200])
        return True

    def take(self) -> GuardMessage | None:
        """The oldest message read and not yet taken (None: none)."""
        return self._ready.popleft() if self._ready else None


class _GuardProcess:
    """The guard's side, once it has its spec: heartbeats, watching the
    parent, and the release of a dead parent's memory."""

    def __init__(self, spec: GuardSpec) -> None:
        self.spec = spec
        self.stop = threading.Event()
        self.master: MasterClient
        if spec.curve_active:
            from kvpool.core.auth import CurveConfig

            self.master = master_stub(spec.master_address, spec.rpc_timeout_s,
                                      CurveConfig(**spec.curve))
        else:
            from kvpool.core.rpc_client import MasterClient

            self.master = MasterClient(spec.master_address, timeout_s=spec.rpc_timeout_s)
        self.beats = 0

    def heartbeats(self) -> None:
        from kvpool.core.protocol import Ping
        from kvpool.core.rpc_client import MasterRPCError

        spec = self.spec
        while not self.stop.wait(spec.interval_s):
            try:
                self.master.call(Ping(spec.client_id, heartbeat=True))
                self.beats += 1
            except MasterRPCError as exc:
                log.debug("heartbeat failed: %s", exc)

    def watch(self, messages: _Messages) -> bool:
        """Block until the parent exits (True) or says it is done (False)."""
        parent = self.spec.parent_pid
        pidfd = _pidfd(parent)
        if os.getppid() != parent:
            return True  # gone before we could watch it
        poller = select.poll()
        poller.register(messages.fd, select.POLLIN)
        if pidfd >= 0:
            poller.register(pidfd, select.POLLIN)
        while True:
            while (msg := messages.take()) is not None:
                if type(msg) is GuardClose:
                    return False
                log.warning("guard: a second spec ignored")
            events = poller.poll(None if pidfd >= 0 else 200)
            if pidfd < 0 and os.getppid() != parent:
                return True
            for fd, _ev in events:
                if fd == pidfd:
                    return True
                if not messages.read():
                    # every write end closed: the parent died (its files close
                    # just before its exit is signalled) or let go of us
                    return self._exits_soon(pidfd, parent)

    @staticmethod
    def _exits_soon(pidfd: int, parent: int, within_s: float = 1.0) -> bool:
        if pidfd >= 0:
            return bool(select.select([pidfd], [], [], within_s)[0])
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if os.getppid() != parent:
                return True
            time.sleep(0.02)
        return False

    def release(self) -> None:
        """The parent is dead: free its shared memory and unmount it."""
        from kvpool.core.errors import ErrorCode
        from kvpool.core.protocol import UnmountSegment
        from kvpool.core.rpc_client import MasterRPCError

        spec = self.spec
        for sid, name in spec.shm.items():
            try:
                os.unlink(os.path.join("/dev/shm", name))
                log.warning("client %s (pid %d) died: removed its shared memory %s (%s)",
                            spec.client_id[:8], spec.parent_pid, name, sid)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.error("cannot remove /dev/shm/%s: %s", name, exc)
        pending = list(spec.shm)
        deadline = time.monotonic() + max(_UNMOUNT_RETRY_S, 3 * spec.rpc_timeout_s)
        while pending and time.monotonic() < deadline:
            sid = pending[0]
            try:
                self.master.call(UnmountSegment(spec.client_id, sid))
            except MasterRPCError as exc:
                if exc.code in (ErrorCode.RPC_TIMEOUT, ErrorCode.RPC_FAIL,
                                ErrorCode.WRITE_OUTCOME_UNKNOWN):
                    time.sleep(min(1.0, spec.interval_s))
                    continue  # the master is away: try again
                # SEGMENT_NOT_FOUND: already gone; PERMISSION_DENIED: someone
                # else owns the id now; either way not ours to unmount
                log.info("unmount %s: %s", sid, exc)
            pending.pop(0)
        if pending:
            log.error("could not unmount %s: the master drops them after its grace period",
                      pending)


def _serve(guard: _GuardProcess, messages: _Messages, stdout_fd: int) -> int:
    beat = threading.Thread(target=guard.heartbeats, name="kvpool-guard-beat", daemon=True)
    beat.start()
    try:
        os.write(stdout_fd, _READY)
    except OSError:
        pass  # the parent is gone already (it does not wait for this answer): watch() sees it
    died = guard.watch(messages)
    guard.stop.set()
    if died:
        guard.release()
    guard.master.close()
    return 0


def _first_spec(messages: _Messages) -> _GuardProcess | None:
    """Wait for the parent's spec and build the guard from it; None when a
    close or EOF comes first (nothing to guard)."""
    while True:
        msg = messages.take()
        if msg is None:
            if not messages.read():
                return None
        elif isinstance(msg, GuardClose):
            return None
        else:
            try:
                return _GuardProcess(msg)
            except Exception as exc:  # e.g. bad curve fields: the guard never dies of its input
                log.warning("guard: unusable spec skipped: %s", exc)


def main() -> int:
    """Entry point of ``python -m kvpool.store.guard`` (see the module docstring).
    Exits 0 after a close or the cleanup, 1 when its stdin ended before a spec."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s kvpool-guard[{os.getpid()}] %(levelname)s "
                               "%(message)s")
    messages = _Messages(sys.stdin.fileno())
    guard = _first_spec(messages)
    if guard is None:
        return 1 if messages.eof else 0
    logging.getLogger().setLevel(guard.spec.log_level)
    return _serve(guard, messages, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
