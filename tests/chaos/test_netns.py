"""The chaos infrastructure: namespaces talk over the bridge, faults bite, teardown is clean."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.netns import Host, Topology, list_netns

PROBE = str(Path(__file__).with_name("netprobe.py"))
PORT = 47001


def _serve(host: Host) -> subprocess.Popen[str]:
    proc = host.popen([sys.executable, PROBE, "serve", host.address, str(PORT)],
                      stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    return proc


def _send(host: Host, server: Host, nbytes: int, timeout_s: float) -> dict[str, object]:
    out = host.run([sys.executable, PROBE, "send", server.address, str(PORT), str(nbytes),
                    str(timeout_s)], timeout=timeout_s + 20)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.fixture
def topo() -> Iterator[Topology]:
    with Topology(["a", "b", "c"]) as t:
        yield t


def test_hosts_talk_over_the_bridge(topo: Topology) -> None:
    a, b, c = topo.host("a"), topo.host("b"), topo.host("c")
    assert len({a.address, b.address, c.address}) == 3
    _serve(a)
    r = _send(b, a, 256 * 1024, 5)
    assert r["ok"], r
    assert _send(c, a, 1, 5)["ok"]
    # each namespace sees only its own address on eth0
    out = b.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert b.address in out and a.address not in out


def test_link_down_partitions_and_link_up_heals(topo: Topology) -> None:
    a, b = topo.host("a"), topo.host("b")
    _serve(a)
    assert _send(b, a, 1024, 5)["ok"]
    topo.link_down("a")
    r = _send(b, a, 1024, 1.5)
    assert not r["ok"] and r["error"], r
    # a partition is silence, not a refusal: the attempt used (most of) its timeout
    assert float(r["seconds"]) >= 1.0  # type: ignore[arg-type]
    topo.link_up("a")
    deadline = time.monotonic() + 10
    while not (r := _send(b, a, 1024, 2))["ok"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r["ok"], r


def test_tbf_slows_only_the_slowed_host(topo: Topology) -> None:
    a, b, c = topo.host("a"), topo.host("b"), topo.host("c")
    _serve(a)
    _serve(c)
    nbytes = 1 << 20
    fast = _send(b, a, nbytes, 10)
    topo.slow("a", rate="8mbit", burst="32kb", latency="500ms")
    slowed = _send(b, a, nbytes, 30)
    other = _send(b, c, nbytes, 10)
    assert fast["ok"] and slowed["ok"] and other["ok"], (fast, slowed, other)
    # 1 MiB at 8 Mbit/s needs >= ~1.0 s; load can only make it slower
    assert float(slowed["seconds"]) >= 0.8, slowed  # type: ignore[arg-type]
    assert float(other["seconds"]) < float(slowed["seconds"])  # type: ignore[arg-type]
    topo.unslow("a")
    assert float(_send(b, a, nbytes, 10)["seconds"]) < float(slowed["seconds"])  # type: ignore[arg-type]


def test_teardown_kills_processes_and_removes_namespaces() -> None:
    topo = Topology(["x", "y"]).setup()
    names = topo.netns_names()
    assert set(names) <= set(list_netns())
    sleeper = topo.host("x").popen(["sleep", "600"])
    # a process the topology did not start itself, left inside the namespace
    orphan = topo.host("y").popen(["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE,
                                  text=True)
    assert orphan.stdout is not None
    orphan_pid = int(orphan.stdout.readline())
    topo.close()
    assert sleeper.poll() is not None
    assert not set(names) & set(list_netns())
    assert not Path(f"/proc/{orphan_pid}").exists() or "zombie" in Path(
        f"/proc/{orphan_pid}/status").read_text().lower()
    topo.close()  # idempotent
