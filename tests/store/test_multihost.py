"""A pool across hosts addressed by their IPs, started from every entry point.

Two network namespaces (``master`` and ``node``, each with its own address
on a bridge) stand for two hosts. The master binds its namespace's address;
Mooncake-compatible stores run as separate processes (multihost_agent.py)
inside the namespaces with ``local_hostname`` = their own IP. The namespaces
share this machine's hostname and /dev/shm, so each store is given its own
host id (through ``KVPOOL_CONFIG`` or the dict form): every byte between the
"hosts" then crosses the veth links over tcp. Bytes are checked by sha256.

- default security (no keys anywhere): positional and dict setup; the dict
  form with ``"curve": {"enabled": False}``;
- CURVE from every entry point: the master's ``--curve-key``, a store's
  ``KVPOOL_CURVE_KEY_DIR``, a node daemon's ``--config`` YAML and a store's
  ``KVPOOL_CONFIG`` YAML; the master reports CURVE on.

Needs root (network namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from support.netns import Host, Topology, cleanup_stale, probe

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

AGENT = str(Path(__file__).with_name("multihost_agent.py"))
PORT = 50061
SEG = 32 << 20


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    try:
        cleanup_stale()
    except Exception:  # a failing cleanup must not hide the probe's reason
        pass
    reason = probe()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    with Topology(["master", "node"], subnet="10.232.0") as t:
        yield t


def _expected(seed: int, size: int) -> str:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return hashlib.sha256(data.tobytes()).hexdigest()


class Agent:
    """A store process in a namespace, one JSON request/reply at a time."""

    def __init__(self, host: Host, log_dir: Path, name: str,
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        full_env = dict(os.environ, **(env or {}))
        self.proc = host.popen([sys.executable, "-u", AGENT], env=full_env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=self._log, text=True)

    def call(self, timeout_s: float = 60, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            raise AssertionError(f"agent gave no answer to {req['op']}: "
                                 f"{self.log_path.read_text()[-3000:]}")
        return dict(json.loads(box[0]))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(timeout_s=30, op="close")
                self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
            self._log.close()


def _start_master(topo: Topology, tmp: Path, *flags: str) -> subprocess.Popen[bytes]:
    host = topo.host("master")
    log = open(tmp / "master.log", "wb")
    proc = host.popen([sys.executable, "-m", "kvpool.cluster.cli", "master", "--host",
                       host.address, "--port", str(PORT), "--metrics-port", "0",
                       "--data-dir", str(tmp / "data"), *flags], stdout=log,
                      stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError((tmp / "master.log").read_text())
        if "listening on" in (tmp / "master.log").read_text():
            return proc
        time.sleep(0.1)
    raise AssertionError("master did not start: " + (tmp / "master.log").read_text())


def _stop(topo: Topology, proc: subprocess.Popen[Any]) -> None:
    topo.kill(proc, sig=15, wait_s=20)


def _both_ways(a: Agent, b: Agent, a_host: str, b_host: str) -> None:
    """``a`` writes onto ``b``'s segment and reads back; ``b`` reads it; and the
    reverse; plus one multi-buffer batch each way. Every byte checked."""
    for src, dst, dst_host, seed in ((a, b, b_host, 1), (b, a, a_host, 2)):
        key = f"k{seed}"
        assert src.call(op="put", key=key, seed=seed, size=3 << 20, preferred=dst_host)["rc"] == 0
        for reader in (dst, src):
            got = reader.call(op="get", key=key)
            assert got == {"n": 3 << 20, "sha": _expected(seed, 3 << 20)}
        keys = [f"m{seed}_{i}" for i in range(4)]
        put = src.call(op="put_multi", keys=keys, seed=seed * 1000, parts=3, part_size=64 << 10,
                       preferred=dst_host)
        assert put["rc"] == [0] * 4
        got = dst.call(op="get_multi", keys=keys, seed=seed * 1000, parts=3, part_size=64 << 10)
        assert got["rc"] == [3 * (64 << 10)] * 4
        want = [hashlib.sha256(b"".join(
            np.random.default_rng(seed * 1000 + i * 100 + j).integers(
                0, 256, 64 << 10, dtype=np.uint8).tobytes() for j in range(3))).hexdigest()
            for i in range(4)]
        assert got["sha"] == want


def test_default_security_positional_and_dict_setup(topo: Topology, tmp_path: Path) -> None:
    master = _start_master(topo, tmp_path)
    m_ip, n_ip = topo.address("master"), topo.address("node")
    addr = f"{m_ip}:{PORT}"
    node_yaml = tmp_path / "node.yaml"
    node_yaml.write_text("host_id: node\n")
    node = Agent(topo.host("node"), tmp_path, "node", env={"KVPOOL_CONFIG": str(node_yaml)})
    local = Agent(topo.host("master"), tmp_path, "local")
    try:
        r = node.call(op="setup", form="positional", local_hostname=n_ip, master=addr,
                      segment=SEG)
        assert r["rc"] == 0, node.log_path.read_text()
        assert r["hostname"].startswith(f"{n_ip}:")
        r2 = local.call(op="setup", form="dict", local_hostname=m_ip, master=addr, segment=SEG,
                        extra={"curve": {"enabled": False}, "host_id": "master"})
        assert r2["rc"] == 0, local.log_path.read_text()
        _both_ways(node, local, r["hostname"], r2["hostname"])
        stats = node.call(op="stats")
        assert stats["curve"] is False
        # the one warning line says why traffic is plain
        assert "CURVE is off on non-loopback address" in node.log_path.read_text()
    finally:
        node.close()
        local.close()
        _stop(topo, master)


def test_curve_from_cli_env_and_yaml(topo: Topology, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "keygen", "--out",
                          str(keys)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    secret = keys / "cluster.key_secret"
    master = _start_master(topo, tmp_path, "--curve-key", str(secret))
    m_ip, n_ip = topo.address("master"), topo.address("node")
    addr = f"{m_ip}:{PORT}"
    # a node daemon from the CLI with a YAML config (CURVE key in it)
    yaml_path = tmp_path / "client.yaml"
    yaml_path.write_text(f"master_address: \"{addr}\"\nmemory_size: 32MiB\n"
                         f"bind_host: \"{n_ip}\"\nhost_id: node\n"
                         f"curve:\n  secret_key_file: \"{secret}\"\n")
    ready = tmp_path / "daemon.ready"
    dlog = open(tmp_path / "daemon.log", "wb")
    daemon = topo.host("node").popen(
        [sys.executable, "-m", "kvpool.cluster.cli", "client", "--config", str(yaml_path),
         "--ready-file", str(ready)], stdout=dlog, stderr=subprocess.STDOUT)
    dlog.close()
    # a store with the key directory in the environment (positional setup)
    node_yaml = tmp_path / "node.yaml"
    node_yaml.write_text("host_id: node\n")
    node = Agent(topo.host("node"), tmp_path, "node",
                 env={"KVPOOL_CURVE_KEY_DIR": str(keys), "KVPOOL_CONFIG": str(node_yaml)})
    # a store whose whole client config comes from KVPOOL_CONFIG (dict setup)
    store_yaml = tmp_path / "store.yaml"
    store_yaml.write_text(f"curve:\n  secret_key_file: \"{secret}\"\nrpc_timeout_s: 10\n"
                          "host_id: master\n")
    local = Agent(topo.host("master"), tmp_path, "local", env={"KVPOOL_CONFIG": str(store_yaml)})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, "daemon never became ready"
            time.sleep(0.1)
        daemon_seg = json.loads(ready.read_text())["segment_ids"][0]
        r = node.call(op="setup", form="positional", local_hostname=n_ip, master=addr,
                      segment=SEG)
        assert r["rc"] == 0, node.log_path.read_text()
        r2 = local.call(op="setup", form="dict", local_hostname=m_ip, master=addr, segment=SEG)
        assert r2["rc"] == 0, local.log_path.read_text()
        _both_ways(node, local, r["hostname"], r2["hostname"])
        # onto the YAML-configured daemon's segment, read from the other host
        assert local.call(op="put", key="d1", seed=7, size=1 << 20, preferred=daemon_seg)["rc"] == 0
        assert node.call(op="get", key="d1") == {"n": 1 << 20, "sha": _expected(7, 1 << 20)}
        stats = local.call(op="stats")
        assert stats["curve"] is True and stats["curve_denied"] == 0
        assert "CURVE is off" not in node.log_path.read_text()
    finally:
        node.close()
        local.close()
        _stop(topo, daemon)
        _stop(topo, master)
