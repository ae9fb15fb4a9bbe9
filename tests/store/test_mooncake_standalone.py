"""Mooncake's standalone (dummy-client) mode with real processes.

Mooncake's procedure: start the node's real client (``mooncake_client``,
here ``kvpool client``), then in the engine process
``setup_dummy(mem_pool_size, local_buffer_size, "127.0.0.1:<its port>")``.
The daemon answers on its standalone port (``--dummy-port``) with the master,
tenant, host id and its segment; the engine's store needs no configuration
and holds no memory. A daemon killed with SIGKILL leaves the engine's store
returning Mooncake codes (never raising), and ``health_check`` says 2.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.store.daemon import STANDALONE_PATH
from kvpool.store.mooncake import MooncakeDistributedStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    with MasterProcess(data_dir=str(tmp_path_factory.mktemp("m")), lease_ttl_ms=500,
                       client_ttl_s=3) as m:
        yield m


@pytest.fixture(autouse=True)
def no_kvpool_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user's environment: no $KVPOOL_CONFIG."""
    monkeypatch.delenv("KVPOOL_CONFIG", raising=False)


def test_daemon_answers_on_its_dummy_port(master: MasterProcess) -> None:
    port = free_port()
    with NodeDaemonProcess(master.address, "16MiB", extra_args=["--dummy-port", str(port)]) as d:
        assert d.info["dummy_port"] == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{STANDALONE_PATH}",
                                    timeout=5) as r:
            info = json.loads(r.read())
        assert info["master"] == master.address
        assert info["segment_id"] == d.segment_ids[0]
        assert info["host_id"] == d.info["host_id"]
        # a second daemon asked for the same (non-default) port refuses to start
        second = NodeDaemonProcess(master.address, "16MiB",
                                   extra_args=["--dummy-port", str(port)])
        try:
            with pytest.raises(Exception, match="dummy_port"):
                second.start()
        finally:
            second.close()  # its log directory


def test_engine_process_puts_and_gets_through_the_daemons_memory(
        master: MasterProcess) -> None:
    port = free_port()
    with NodeDaemonProcess(master.address, "32MiB", extra_args=["--dummy-port", str(port)]) as d:
        store = MooncakeDistributedStore()
        assert store.setup_dummy(64 << 20, 16 << 20, f"127.0.0.1:{port}") == 0
        try:
            assert store.get_hostname() == d.segment_ids[0]
            assert store.put("sa/k", b"v" * 5000) == 0
            assert store.get("sa/k") == b"v" * 5000
            (desc,) = store.get_replica_desc("sa/k")
            assert desc.is_memory_replica() and desc.segment_id == d.segment_ids[0]
            assert store._c().segment_ids == []  # the engine holds no memory
            assert store.health_check() == 0
            # zero-copy buffers from the pool of mem_pool_size bytes, as Mooncake's dummy client
            ptr = store.alloc_from_mem_pool(4096)
            assert ptr != 0
            ctypes.memmove(ptr, b"z" * 4096, 4096)
            assert store.register_buffer(ptr, 4096) == 0
            assert store.put_from("sa/zc", ptr, 4096) == 0
            assert store.get("sa/zc") == b"z" * 4096
            assert store.alloc_from_mem_pool(64 << 20) == 0  # 4096 bytes of it are gone
        finally:
            store.close()


ENGINE = r"""
import sys, time
from kvpool.store.mooncake import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup_dummy(64 << 20, 16 << 20, sys.argv[1]) == 0
assert s.put("k9/a", b"a" * 4096) == 0
print("ready", flush=True)
sys.stdin.readline()  # the test kills the daemon meanwhile
deadline = time.monotonic() + 15
codes = []
while time.monotonic() < deadline:
    codes = [s.put("k9/b%d" % len(codes), b"b" * 4096), len(s.get("k9/a")),
             s.is_exist("k9/a"), s.health_check()]
    if codes[0] < 0 and codes[1] == 0:
        break
    time.sleep(0.2)
print("codes", codes, flush=True)
s.close()
"""


def test_daemon_killed_engine_gets_codes_not_tracebacks(master: MasterProcess) -> None:
    port = free_port()
    d = NodeDaemonProcess(master.address, "16MiB",
                          extra_args=["--dummy-port", str(port)]).start()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, f"127.0.0.1:{port}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if k != "KVPOOL_CONFIG"})
    try:
        assert engine.stdout is not None and engine.stdin is not None
        assert engine.stdout.readline().strip() == "ready"
        d.kill()  # SIGKILL
        engine.stdin.write("go\n")
        engine.stdin.flush()
        out, err = engine.communicate(timeout=40)
        assert engine.returncode == 0, err[-2000:]
        assert "Traceback" not in err
        (line,) = [x for x in out.splitlines() if x.startswith("codes")]
        put, got, exists, health = json.loads(line.split(" ", 1)[1])
        assert put == -200  # NO_AVAILABLE_HANDLE: the only memory of the pool went
        assert got == 0 and exists == 0
        assert health == 2  # the node holding the memory does not answer
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        d.__exit__()


def test_nothing_at_the_address_is_a_code(master: MasterProcess) -> None:
    store = MooncakeDistributedStore()
    assert store.setup_dummy(1 << 20, 16 << 20, f"127.0.0.1:{free_port()}") == -1
    # the master's address is not a node's client: -1 too, not a hang
    assert store.setup_dummy(1 << 20, 16 << 20, master.address) == -1
    assert store.health_check() == 1


def test_kvpool_config_path_still_works(master: MasterProcess, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With $KVPOOL_CONFIG naming the master, an address where nothing
    answers falls back to it (a daemon of this host must hold memory)."""
    cfg = tmp_path / "client.yaml"
    cfg.write_text(f"master_address: {master.address}\n")
    monkeypatch.setenv("KVPOOL_CONFIG", str(cfg))
    with NodeDaemonProcess(master.address, "16MiB", extra_args=["--dummy-port", "0"]):
        store = MooncakeDistributedStore()
        assert store.setup_dummy(1 << 20, 16 << 20, f"127.0.0.1:{free_port()}") == 0
        try:
            assert store.put("cfg/k", b"x") == 0 and store.get("cfg/k") == b"x"
        finally:
            store.close()
