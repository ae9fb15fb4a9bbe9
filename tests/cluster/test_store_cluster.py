"""Multi-process store scenarios: a real master, node daemons and client
processes on loopback (concurrency with checksums, eviction, master restart,
replica failover, lease expiry, daemon shutdown, CLI tools)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import ListSegments
from kvpool.store import Client, ClientConfig, ReplicateConfig
from kvpool.store.errors import LeaseExpired, MasterUnreachable, ObjectNotFound, StoreTimeout


@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[MasterProcess, list[NodeDaemonProcess]]]:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path / "m"), lease_ttl_ms=2000, client_ttl_s=2) as m:
        ds = [NodeDaemonProcess(m.address, "48MiB", log_dir=str(tmp_path / f"d{i}"))
              for i in range(2)]
        try:
            for d in ds:
                d.start()
            yield m, ds
        finally:
            for d in ds:
                d.stop()


def _value(key: str, size: int) -> bytes:
    seed = zlib.crc32(key.encode())
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _worker(address: str, wid: int, n: int, nworkers: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Put own keys, read everyone's; report (puts, verified reads, bad reads, errors)."""
    puts = reads = bad = 0
    errors: list[str] = []
    rng = np.random.default_rng(wid)
    try:
        with Client(ClientConfig(master_address=address, checksum="crc32")) as c:
            for i in range(n):
                key = f"w{wid}/{i}"
                size = int(rng.integers(1, 256 << 10))
                rc = ReplicateConfig(replica_num=1 + i % 2)
                if i % 4 == 3:  # batch form every fourth step
                    keys = [f"{key}/b{j}" for j in range(4)]
                    codes = c.put_batch(keys, [_value(k, size) for k in keys], rc)
                    puts += sum(1 for x in codes if x == ErrorCode.OK)
                    got = c.get_batch(keys)
                    for k, g in zip(keys, got, strict=True):
                        reads += g is not None
                        bad += g is not None and g != _value(k, size)
                else:
                    c.put(key, _value(key, size), rc)
                    puts += 1
                other = f"w{int(rng.integers(0, nworkers))}/{int(rng.integers(0, i + 1))}"
                try:
                    got1 = c.get(other)
                    reads += 1
                    bad += got1 != _value(other, len(got1))
                except Exception as exc:  # not written (or still being written): fine
                    if getattr(exc, "code", None) not in (ErrorCode.OBJECT_NOT_FOUND,
                                                          ErrorCode.REPLICA_IS_NOT_READY):
                        errors.append(repr(exc))
    except Exception as exc:
        errors.append(repr(exc))
    q.put((wid, puts, reads, bad, errors))


def test_concurrent_clients_with_checksums(cluster) -> None:  # type: ignore[no-untyped-def]
    master, _ = cluster
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    nworkers, n = 3, 40
    procs = [ctx.Process(target=_worker, args=(master.address, w, n, nworkers, q))
             for w in range(nworkers)]
    for p in procs:
        p.start()
    results = [q.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    for wid, puts, reads, bad, errors in results:
        assert errors == [], (wid, errors)
        assert bad == 0
        assert puts == n // 4 * 4 + (n - n // 4)
        assert reads > n // 2


def test_eviction_lets_puts_continue_past_capacity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path / "m")) as m, \
            NodeDaemonProcess(m.address, "16MiB", log_dir=str(tmp_path / "d")), \
            Client(ClientConfig(master_address=m.address)) as c:
        n = 64  # 64 MiB through a 16 MiB pool
        for i in range(n):
            c.put(f"e{i}", _value(f"e{i}", 1 << 20))
        stats = c.stats()
        assert stats.evictions >= n - 16
        assert stats.bytes_used <= 16 << 20
        assert c.get(f"e{n - 1}") == _value(f"e{n - 1}", 1 << 20)
        assert c.exists("e0") is False


def test_master_restart_remounts_and_keeps_data(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path / "m")) as m, \
            NodeDaemonProcess(m.address, "16MiB", log_dir=str(tmp_path / "d")) as d, \
            Client(ClientConfig(master_address=m.address, ping_interval_s=0.2,
                                rpc_timeout_s=1.0)) as c:
        c.put("survivor", b"s" * 10000)
        m.kill()
        t = time.monotonic()
        with pytest.raises(MasterUnreachable):  # bounded by rpc_timeout_s, never hangs
            c.put("while-down", b"x")
        assert time.monotonic() - t < 5
        m.start()
        deadline = time.monotonic() + 15
        while True:
            try:
                with m.client(timeout_s=1) as mc:
                    segs = {s.descriptor.segment_id: s for s in mc.call(ListSegments()).segments}
                seg = segs.get(d.segment_ids[0])
                if seg is not None and seg.state == "active":
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "daemon did not re-mount after master restart"
            time.sleep(0.2)
        assert c.get("survivor") == b"s" * 10000
        c.put("after", b"a")
        assert c.get("after") == b"a"


def test_read_fails_over_to_next_replica(cluster) -> None:  # type: ignore[no-untyped-def]
    master, daemons = cluster
    # host_id differs from the daemons': every transfer goes through their tcp servers
    with Client(ClientConfig(master_address=master.address, host_id="elsewhere",
                             checksum="crc32")) as c:
        keys = [f"r{i}" for i in range(8)]
        for k in keys:
            c.put(k, _value(k, 300_000), ReplicateConfig(replica_num=2))
        assert all(len(c.replica_segments(k)) == 2 for k in keys)
        daemons[0].kill()  # the master still lists its segment for client_ttl
        for k in keys:
            assert c.get(k) == _value(k, 300_000)
        # after the master drops the dead daemon every key has one replica left
        deadline = time.monotonic() + 10
        while len(c.replica_segments(keys[0])) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert c.get_batch(keys) == [_value(k, 300_000) for k in keys]


def test_read_past_lease_deadline_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path / "m"), lease_ttl_ms=1) as m, \
            NodeDaemonProcess(m.address, "40MiB", log_dir=str(tmp_path / "d")), \
            Client(ClientConfig(master_address=m.address, host_id="elsewhere")) as c:
        c.put("big", bytes(32 << 20))  # a 32 MiB tcp read cannot finish within 1 ms
        with pytest.raises(LeaseExpired) as ei:
            c.get("big")
        assert ei.value.code == ErrorCode.LEASE_EXPIRED
        assert c.batch_get_into(["big"], [bytearray(32 << 20)]) == [ErrorCode.LEASE_EXPIRED]


def test_daemon_sigterm_unmounts_cleanly_and_status(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path / "m")) as m:
        d = NodeDaemonProcess(m.address, "8MiB", host_id="node-a", log_dir=str(tmp_path / "d"))
        d.start()
        (shm,) = d.info["shm_names"]
        assert os.path.exists(f"/dev/shm/{shm}")
        out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "status",
                              "--master", m.address], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert d.segment_ids[0] in out.stdout and "node-a" in out.stdout
        assert "memory" in out.stdout and "8.0MiB" in out.stdout and "uptime" in out.stdout
        assert d.stop() == 0
        assert not os.path.exists(f"/dev/shm/{shm}")
        with m.client() as mc:
            assert mc.call(ListSegments()).segments == []
        d.__exit__()
        bad = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "client", "--master",
                              m.address, "--memory", "lots"], capture_output=True, text=True,
                             timeout=30)
        assert bad.returncode != 0 and "CONFIG_ERROR" in bad.stderr


def test_demo_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cluster.cli", "demo", "--requests", "12",
         "--memory", "48MiB", "--max-value", "4MiB", "--no-progress"],
        capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "p50 ms" in out.stdout and "hit rate" in out.stdout
    m = re.search(r"still readable and intact: (\d+)/(\d+)", out.stdout)
    assert m is not None and m.group(1) == m.group(2) and int(m.group(2)) >= 4


def test_daemon_restart_with_same_segment_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A segment id that comes back naming a new shm region must not be served
    from the client's cached mapping of the old one."""
    with MasterProcess(data_dir=str(tmp_path / "m"), client_ttl_s=2) as m, \
            NodeDaemonProcess(m.address, "8MiB", extra_args=["--segment-id", "fixed-seg"],
                              log_dir=str(tmp_path / "d")) as d, \
            Client(ClientConfig(master_address=m.address, checksum="crc32")) as c:
        c.put("before", b"1" * 5000)
        old_shm = d.info["shm_names"][0]
        d.restart()
        assert d.segment_ids == ["fixed-seg"] and d.info["shm_names"][0] != old_shm
        with pytest.raises(ObjectNotFound):  # left with the old region's clean unmount
            c.get("before")
        c.put("after", b"2" * 5000)
        with Client(ClientConfig(master_address=m.address)) as fresh:
            assert fresh.get("after") == b"2" * 5000
        assert c.get("after") == b"2" * 5000


def test_put_to_a_stalled_holder_times_out_and_is_revoked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with MasterProcess(data_dir=str(tmp_path / "m"), client_ttl_s=30) as m, \
            NodeDaemonProcess(m.address, "8MiB", log_dir=str(tmp_path / "d")) as d, \
            Client(ClientConfig(master_address=m.address, host_id="elsewhere",
                                transfer_timeout_s=0.5)) as c:
        assert d.pid is not None
        os.kill(d.pid, signal.SIGSTOP)  # alive but silent: its transfer server never answers
        try:
            t = time.monotonic()
            with pytest.raises(StoreTimeout):
                c.put("stalled", b"z" * 100_000)
            assert time.monotonic() - t < 5
            assert c.exists("stalled") is False  # revoked, not left half-written
        finally:
            os.kill(d.pid, signal.SIGCONT)
        c.put("later", b"ok")
        assert c.get("later") == b"ok"
