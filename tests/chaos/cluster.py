"""A kvpool cluster spread over network namespaces, for the chaos scenarios.

Layout: the master in namespace ``master``, node daemons ``node1..N`` each in
its own namespace with its own address and host id (so transfers between
them and the workload clients go over tcp, never shm), workload agents
``wl1..M`` (``workload.py agent``) in others. Only the namespaces' private
addresses are used.

Commands started (the contract this harness assumes; see docs/INTERFACES.md):

- ``kvpool master --host ADDR --port P --metrics-port 0 --data-dir D
  --client-ttl-s T --client-grace-s G --lease-ttl-ms L --curve off``
- ``kvpool client --master ADDR:P --memory 64MiB --host-id nodeN
  --bind-host ADDR --ready-file F --curve off``

``--curve off``: the chaos suite tests faults, not authentication, and the
private addresses are non-loopback (CURVE would be on by default). Flags are
passed only when the subcommand's ``--help`` lists them, so the harness runs
before and after CURVE is wired in.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from support.netns import Host, Topology

__all__ = ["Agent", "ChaosCluster", "ClusterError"]

WORKLOAD = str(Path(__file__).with_name("workload.py"))
# KVPOOL_CHAOS_LOG_LEVEL=DEBUG makes the master and node daemons log verbosely
LOG_LEVEL = os.environ.get("KVPOOL_CHAOS_LOG_LEVEL", "INFO")
MASTER_PORT = 50051


class ClusterError(RuntimeError):
    """A cluster process did not start, exited, or did not answer in time."""


@functools.cache
def _cli_flags(sub: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", sub, "--help"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout


class Agent:
    """The test's handle on one workload agent process (JSON lines over pipes)."""

    def __init__(self, host: Host, proc: subprocess.Popen[str], log_path: str) -> None:
        self.host = host
        self.proc = proc
        self.log_path = log_path
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next reply; raises ClusterError when none comes in time (a hung request)."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise ClusterError(f"agent on {self.host.name}: no reply within {timeout_s}s "
                               f"(a request hangs); log tail:\n{self.log_tail()}") from None
        if line is None:
            raise ClusterError(f"agent on {self.host.name} exited ({self.proc.poll()}):\n"
                               + self.log_tail())
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise ClusterError(f"agent on {self.host.name}: {reply['error']}")
        return reply

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd: str, timeout_s: float = 30, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.recv(timeout_s)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send("quit")
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.host.topology.kill(self.proc)


class ChaosCluster:
    """Master + ``nodes`` daemons + ``workloads`` agents, each in its own namespace."""

    def __init__(self, workdir: Path, nodes: int = 3, workloads: int = 2,
                 client_ttl_s: float = 3.0, client_grace_s: float = 4.0,
                 lease_ttl_ms: int = 10000,
                 node_memory: str = "64MiB", rpc_timeout_s: float = 2.0,
                 transfer_timeout_s: float = 4.0) -> None:
        self.workdir = workdir
        self.client_ttl_s = client_ttl_s
        self.client_grace_s = client_grace_s
        self.lease_ttl_ms = lease_ttl_ms
        self.node_memory = node_memory
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.wl_names = [f"wl{i + 1}" for i in range(workloads)]
        self.topo = Topology(["master", *self.node_names, *self.wl_names])
        self.master_proc: subprocess.Popen[bytes] | None = None
        self.node_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.node_info: dict[str, dict[str, Any]] = {}
        self.agents: dict[str, Agent] = {}
        self._logs: list[IO[bytes]] = []
        self._starts: dict[str, int] = {}
        self.data_dir = workdir / "master-data"
        self._master_flags = ""
        self._client_flags = ""

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> ChaosCluster:
        try:
            self.topo.setup()
            self._master_flags = _cli_flags("master")
            self._client_flags = _cli_flags("client")
            self.start_master()
            for n in self.node_names:
                self._spawn_node(n)
            for n in self.node_names:
                self._wait_node(n)
            for w in self.wl_names:
                self.agents[w] = self._start_agent(w)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> ChaosCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def master_address(self) -> str:
        return f"{self.topo.address('master')}:{MASTER_PORT}"

    def _log(self, name: str) -> tuple[IO[bytes], str]:
        self._starts[name] = self._starts.get(name, 0) + 1
        path = str(self.workdir / f"{name}-{self._starts[name]}.log")
        f = open(path, "ab")
        self._logs.append(f)
        return f, path

    def _curve_off(self, flags: str) -> list[str]:
        return ["--curve", "off"] if "--curve" in flags else []

    def start_master(self) -> None:
        """Start (or restart) the master from its data dir; return once it answers."""
        host = self.topo.host("master")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        f, path = self._log("master")
        cmd = [sys.executable, "-m", "kvpool.cluster.cli", "--log-level", LOG_LEVEL, "master",
               "--host", host.address,
               "--port", str(MASTER_PORT), "--metrics-port", "0", "--data-dir",
               str(self.data_dir), "--client-ttl-s", str(self.client_ttl_s),
               "--lease-ttl-ms", str(self.lease_ttl_ms), *self._curve_off(self._master_flags)]
        if "--client-grace-s" in self._master_flags:
            cmd += ["--client-grace-s", str(self.client_grace_s)]
        self.master_proc = host.popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        # probe from another namespace: also checks the bridge path
        probe = self.topo.host(self.wl_names[0] if self.wl_names else "master")
        r = probe.run([sys.executable, WORKLOAD, "probe", self.master_address, "30"], timeout=60)
        if r.returncode != 0:
            raise ClusterError(f"master not answering at {self.master_address}:\n"
                               + Path(path).read_text(errors="replace")[-3000:])

    def kill_master(self) -> None:
        """kill -9 the master (a crash)."""
        assert self.master_proc is not None
        self.topo.kill(self.master_proc)

    def _spawn_node(self, name: str) -> None:
        host = self.topo.host(name)
        f, _ = self._log(name)
        ready = self.workdir / f"{name}-ready-{self._starts[name]}.json"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        cmd = [sys.executable, "-m", "kvpool.cluster.cli", "--log-level", LOG_LEVEL,
               "client", "--master",
               self.master_address, "--memory", self.node_memory, "--host-id", name,
               "--bind-host", host.address, "--ready-file", str(ready),
               *self._curve_off(self._client_flags)]
        self.node_procs[name] = host.popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.node_info[name] = {"ready_file": str(ready)}

    def _wait_node(self, name: str, timeout_s: float = 60) -> None:
        ready = Path(self.node_info[name]["ready_file"])
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.node_procs[name].poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"node {name} did not become ready:\n"
                                   + self.log_tail(name))
            time.sleep(0.05)
        self.node_info[name].update(json.loads(ready.read_text()))

    def segment_of(self, node: str) -> str:
        """The memory segment id of ``node``'s daemon."""
        return str(self.node_info[node]["segment_ids"][0])

    def kill_node(self, name: str) -> None:
        """kill -9 a node daemon's process group. Its guard process (its own
        session) survives, frees its shared memory and unmounts it; close()
        removes whatever is left."""
        self.topo.kill(self.node_procs[name])

    def shm_files(self, name: str) -> list[str]:
        """The node daemon's /dev/shm files that still exist."""
        return [n for n in self.node_info[name].get("shm_names", [])
                if os.path.exists(os.path.join("/dev/shm", n))]

    def _start_agent(self, name: str) -> Agent:
        host = self.topo.host(name)
        _, path = self._log(name)
        err = open(path, "ab")
        self._logs.append(err)
        cmd = [sys.executable, WORKLOAD, "agent", "--master", self.master_address,
               "--host-id", name, "--bind-host", host.address,
               "--rpc-timeout-s", str(self.rpc_timeout_s),
               "--transfer-timeout-s", str(self.transfer_timeout_s)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = host.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                          text=True, env=env)
        agent = Agent(host, proc, path)
        first = agent.recv(60)
        if not first.get("ready"):
            raise ClusterError(f"agent {name} did not start: {first}")
        return agent

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.workdir / f"{name}-{self._starts.get(name, 1)}.log"
        try:
            return path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        for a in self.agents.values():
            a.close()
        for name, p in self.node_procs.items():
            if p.poll() is None:
                self.topo.kill(p, sig=15, wait_s=10)  # clean unmount: unlinks its shm
            for shm in self.node_info.get(name, {}).get("shm_names", []):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", shm))
        if self.master_proc is not None and self.master_proc.poll() is None:
            self.topo.kill(self.master_proc, sig=15, wait_s=10)
        self.topo.close()
        for f in self._logs:
            with contextlib.suppress(OSError):
                f.close()
        self._logs.clear()
