"""Simulated hosts on one machine: network namespaces joined by a Linux bridge.

Each host is a network namespace with one veth interface (``eth0``) whose
peer is a port of a bridge living in its own namespace, so nothing is added
to the root namespace and deleting the namespaces removes every link. Two
hosts can instead be joined by one veth pair (``direct=True``: a cable, no
switch). Hosts
get addresses in a private test subnet (``10.231.0.0/24`` by default) that
exists only inside these namespaces. Names carry a ``kvp`` prefix, this
process's pid and a per-process counter, so parallel runs never clash and
leftovers of dead runs can be recognised (:func:`cleanup_stale`).

Faults: :meth:`Topology.link_down` takes the host's bridge port down (a
partition: the host's packets vanish silently, no RST, no ICMP);
:meth:`Topology.cut` silently drops the traffic between two hosts only (a
partial partition: each one's neighbour entry for the other names a MAC no
host has, so neither tc filters nor iptables are needed);
:meth:`Topology.slow` rate-limits both directions of its link with a ``tbf``
qdisc (``netem`` is not available in every kernel; ``tbf`` is).

Processes run inside a namespace with ``ip netns exec`` (which execs, so the
Popen pid is the process itself: ``kill -9`` hits it directly), each in its
own session. :meth:`Topology.close` (also on exit via atexit) kills every
process it started plus anything else left in its namespaces, then deletes
the namespaces. Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = [
    "Host",
    "NetnsError",
    "Topology",
    "cleanup_stale",
    "list_netns",
    "probe",
]

log = logging.getLogger(__name__)

PREFIX = "kvp"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)t\d+-")
_counter = itertools.count(1)
_NOWHERE_MAC = "02:00:5e:00:00:01"  # locally administered; no veth of a topology has it
_live: set[Topology] = set()
_live_lock = threading.Lock()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed while building or changing a topology."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 20) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def list_netns() -> list[str]:
    """Names of every network namespace ``ip netns`` knows."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def probe() -> str | None:
    """None when namespaces can be built here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "the chaos suite needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    try:
        with Topology(["a", "b"]) as topo:
            topo.slow("a", rate="100mbit")
            topo.unslow("a")
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create network namespaces/veth/bridge/tbf here: {exc}"
    return None


def cleanup_stale() -> list[str]:
    """Delete ``kvp<pid>t<n>-*`` namespaces whose creating process is gone."""
    removed = []
    for name in list_netns():
        m = _NAME_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # its creator still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _kill_netns_pids(name)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


def _kill_netns_pids(netns: str) -> None:
    out = _run(["ip", "netns", "pids", netns], check=False)
    for tok in out.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


@dataclass(eq=False)
class Host:
    """One simulated host: a namespace with ``eth0`` at ``address``."""

    name: str
    netns: str
    address: str
    port: str  # its port on the bridge (in the bridge namespace)
    topology: Topology = field(repr=False)

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        cwd: str | None = None,
        text: bool = False,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host's namespace (tracked; killed at close)."""
        return self.topology._popen(self, argv, env=env, stdin=stdin, stdout=stdout,
                                    stderr=stderr, cwd=cwd, text=text)

    def run(self, argv: Sequence[str], timeout: float = 30,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace to completion; returns its output (text)."""
        proc = self.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.topology.kill(proc)
            out, err = proc.communicate()
            raise
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


class Topology:
    """N hosts on one bridge. A context manager; ``close()`` is idempotent.

    ``hosts`` are logical names (``"master"``, ``"node1"``...); host i gets
    ``{subnet}.{10 + i}``. Call :meth:`setup` (or enter the context) to build.
    ``direct``: exactly two hosts whose ``eth0`` ends form one veth pair (no
    bridge namespace); faults then act on the hosts' own ``eth0``.
    """

    def __init__(self, hosts: Sequence[str], subnet: str = "10.231.0",
                 direct: bool = False) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError("host names must be unique and non-empty")
        if len(hosts) > 200:
            raise ValueError("at most 200 hosts")
        if direct and len(hosts) != 2:
            raise ValueError("a direct veth pair joins exactly two hosts")
        self.tag = f"{PREFIX}{os.getpid()}t{next(_counter)}"
        self.subnet = subnet
        self.direct = direct
        self.bridge_netns = "" if direct else f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(hosts):
            if not re.fullmatch(r"[A-Za-z0-9_]{1,20}", name):
                raise ValueError(f"bad host name {name!r}")
            self.hosts[name] = Host(name, f"{self.tag}-{name}", f"{subnet}.{10 + i}",
                                    f"p{i}", self)
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._created: list[str] = []
        self._closed = False

    # -- building ---------------------------------------------------------------------------
    def setup(self) -> Topology:
        """Create the bridge namespace, the host namespaces and their links."""
        with _live_lock:
            _live.add(self)
        if self.direct:
            return self._setup_direct()
        try:
            br = self.bridge_netns
            _run(["ip", "netns", "add", br])
            self._created.append(br)
            _run(["ip", "-n", br, "link", "set", "lo", "up"])
            _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", "br0", "up"])
            for h in self.hosts.values():
                _run(["ip", "netns", "add", h.netns])
                self._created.append(h.netns)
                _run(["ip", "link", "add", "eth0", "netns", h.netns, "type", "veth",
                      "peer", "name", h.port, "netns", br])
                _run(["ip", "-n", br, "link", "set", h.port, "master", "br0"])
                _run(["ip", "-n", br, "link", "set", h.port, "up"])
                _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
                _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def _setup_direct(self) -> Topology:
        a, b = self.hosts.values()
        try:
            for h in (a, b):
                _run(["ip", "netns", "add", h.netns])
                self._created.append(h.netns)
            _run(["ip", "link", "add", "eth0", "netns", a.netns, "type", "veth",
                  "peer", "name", "eth0", "netns", b.netns])
            for h in (a, b):
                _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
                _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def _other(self, name: str) -> Host:
        return next(h for n, h in self.hosts.items() if n != name)

    def __enter__(self) -> Topology:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.hosts[name].address

    # -- faults -----------------------------------------------------------------------------
    def link_down(self, name: str) -> None:
        """Partition ``name``: its bridge port goes down, its packets are silently lost."""
        if self.direct:
            _run(["ip", "-n", self.hosts[name].netns, "link", "set", "eth0", "down"])
            return
        _run(["ip", "-n", self.bridge_netns, "link", "set", self.hosts[name].port, "down"])

    def link_up(self, name: str) -> None:
        """Heal a partition made by :meth:`link_down`."""
        if self.direct:
            _run(["ip", "-n", self.hosts[name].netns, "link", "set", "eth0", "up"])
            return
        _run(["ip", "-n", self.bridge_netns, "link", "set", self.hosts[name].port, "up"])

    def cut(self, a: str, b: str) -> None:
        """Silently drop every packet between hosts ``a`` and ``b``, both ways;
        their traffic with everyone else flows. Each one's neighbour (ARP)
        entry for the other points at a MAC no host has: the frames are sent,
        flooded by the bridge and dropped by every receiver."""
        for x, y in ((self.hosts[a], self.hosts[b]), (self.hosts[b], self.hosts[a])):
            _run(["ip", "-n", x.netns, "neigh", "replace", y.address, "lladdr", _NOWHERE_MAC,
                  "dev", "eth0", "nud", "permanent"])

    def uncut(self, a: str, b: str) -> None:
        """Heal a :meth:`cut` (the hosts resolve each other's MAC anew)."""
        for x, y in ((self.hosts[a], self.hosts[b]), (self.hosts[b], self.hosts[a])):
            _run(["ip", "-n", x.netns, "neigh", "del", y.address, "dev", "eth0"], check=False)

    def slow(self, name: str, rate: str = "2mbit", burst: str = "32kb",
             latency: str = "500ms") -> None:
        """Rate-limit both directions of ``name``'s link with a tbf qdisc."""
        h = self.hosts[name]
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _run(["tc", "-n", h.netns, "qdisc", "replace", "dev", "eth0", *tbf])
        if self.direct:
            _run(["tc", "-n", self._other(name).netns, "qdisc", "replace", "dev", "eth0", *tbf])
            return
        _run(["tc", "-n", self.bridge_netns, "qdisc", "replace", "dev", h.port, *tbf])

    def unslow(self, name: str) -> None:
        """Remove the rate limit of :meth:`slow`."""
        h = self.hosts[name]
        _run(["tc", "-n", h.netns, "qdisc", "del", "dev", "eth0", "root"], check=False)
        if self.direct:
            _run(["tc", "-n", self._other(name).netns, "qdisc", "del", "dev", "eth0", "root"],
                 check=False)
            return
        _run(["tc", "-n", self.bridge_netns, "qdisc", "del", "dev", h.port, "root"], check=False)

    # -- processes --------------------------------------------------------------------------
    def _popen(self, host: Host, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        if self._closed:
            raise NetnsError("topology is closed")
        env = kw.pop("env")
        full_env = dict(os.environ) if env is None else dict(env)
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], env=full_env,
                                start_new_session=True, **kw)
        with self._lock:
            self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[Any], sig: int = signal.SIGKILL,
             wait_s: float = 10) -> int | None:
        """Send ``sig`` to ``proc``'s process group and wait for it (SIGKILL: a crash)."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        return proc.returncode

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process started here (and any left in the namespaces); delete them."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            try:
                self.kill(p, signal.SIGKILL, wait_s=5)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("could not kill pid %s: %s", p.pid, exc)
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for ns in reversed(self._created):
            _kill_netns_pids(ns)
            _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()
        with _live_lock:
            _live.discard(self)

    def netns_names(self) -> list[str]:
        hosts = [h.netns for h in self.hosts.values()]
        return hosts if self.direct else [self.bridge_netns, *hosts]

    def __repr__(self) -> str:
        return f"Topology({self.tag}, {list(self.hosts)})"


@atexit.register
def _close_all() -> None:
    with _live_lock:
        live = list(_live)
    for topo in live:
        with contextlib.suppress(Exception):
            topo.close()

