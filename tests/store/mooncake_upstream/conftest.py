"""The environment Mooncake's own store tests expect, built from kvpool.

Mooncake runs these files (``scripts/run_tests.sh``) beside
``mooncake_master --default_kv_lease_ttl=500`` (with ``--root_fs_dir`` and
the offload/promotion flags for the SSD tests) and a ``mooncake_client`` on
127.0.0.1:50052, with ``DEFAULT_KV_LEASE_TTL=500`` and
``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`` in the environment. Here: a kvpool
master (lease TTL 500 ms, promotion at the first disk hit), a node daemon
answering standalone clients on 127.0.0.1:50052 (``kvpool client``, the
default ``--dummy-port``), and the variables the files read
(``MASTER_SERVER`` names the kvpool master).

Changed from Mooncake's values, through the variables the files read:
``PROMOTION_WAIT_SECONDS`` 6 (kvpool's tier tasks run within a ping
interval, 1 s, but a promotion under a fully loaded 2-core CI once took
more than 3 s; Mooncake waits 25 s for its heartbeats) and the SSD tier's
size (``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES``, 256 MiB). Segments are not
prefaulted (``$KVPOOL_CONFIG``: ``prefault: false``), so the 1600 MB
segments the replica-clear tests ask for cost only the bytes written.

``test_multi_dummy_clients.py`` is two processes in Mooncake's script; it is
run that way by ``test_multi_dummy_clients_run.py``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.store.mooncake import MooncakeDistributedStore

collect_ignore = ["test_multi_dummy_clients.py"]

LEASE_TTL_MS = 500
MOONCAKE_CLIENT_PORT = 50052
# read by the files at import (collection), so set before it
os.environ.setdefault("DEFAULT_KV_LEASE_TTL", str(LEASE_TTL_MS))
os.environ.setdefault("PROMOTION_WAIT_SECONDS", "6")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


#: the transfer ports files hard-code in their local_hostname
PORTS = {"test_batch_replica_clear": [12345, 12346],
         "test_replicated_distributed_object_store": [12345, 12346]}


def _close_stores(module: ModuleType) -> None:
    """Close the stores a file's classes keep (Mooncake runs each file in a
    process of its own, whose exit ends them; here the next file needs
    their ports)."""
    for cls in vars(module).values():
        if not isinstance(cls, type):
            continue
        for value in list(vars(cls).values()):
            for store in value if isinstance(value, list) else [value]:
                if isinstance(store, MooncakeDistributedStore):
                    store.close()


#: the files that run beside a node's client (Mooncake: mooncake_client on 50052)
BESIDE_A_NODE = {"test_dummy_client", "test_multi_dummy_clients_run"}


@pytest.fixture(scope="module", autouse=True)
def mooncake_env(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Per file, as Mooncake's script starts them: a master, for the
    standalone files a node daemon on the standalone port, and the
    variables (restored afterwards). Module-scoped and autouse, so it is up
    before the unittest classes' setUpClass."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    beside_node = name in BESIDE_A_NODE
    ports = [MOONCAKE_CLIENT_PORT] if beside_node else PORTS.get(name, [])
    for port in ports:
        if not _port_free(port):
            pytest.fail(f"127.0.0.1:{port} is taken: Mooncake's {name} needs it")
    root = tmp_path_factory.mktemp(name)
    cfg = Path(root, "client.yaml")
    cfg.write_text("prefault: false\n")
    offload = Path(root, "offload")
    offload.mkdir()
    with MasterProcess(data_dir=str(Path(root, "master")), lease_ttl_ms=LEASE_TTL_MS,
                       client_ttl_s=3, extra_args=["--promote-after-hits", "1"]) as master:
        env = {
            "MASTER_SERVER": master.address,
            "MC_METADATA_SERVER": "P2PHANDSHAKE",
            "PROTOCOL": "tcp",
            "KVPOOL_CONFIG": str(cfg),
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(offload),
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(256 << 20),
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            if not beside_node:
                yield env
                return
            with NodeDaemonProcess(master.address, "256MiB",
                                   extra_args=["--dummy-port", str(MOONCAKE_CLIENT_PORT)]) as d:
                if d.info.get("dummy_port") != MOONCAKE_CLIENT_PORT:
                    pytest.fail(f"the node daemon does not answer on {MOONCAKE_CLIENT_PORT}")
                yield env
        finally:
            _close_stores(request.module)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


#: tests Mooncake's own master fails too, and why (not in Mooncake's run_tests.sh)
MOONCAKE_FAILS_TOO = {
    "test_clear_with_active_lease": "expects a read lease right after put; Mooncake's PutEnd "
    "grants none (GrantLease(0, ...) at 28464f3, where the test was added; GrantReadLease(0) "
    "at 3b5a594), and neither does kvpool's",
    "test_clear_mixed_expired_and_active": "same: keys put just before the clear are expected "
    "to hold a lease",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        why = MOONCAKE_FAILS_TOO.get(item.name)
        if why and "mooncake_upstream" in str(item.path):
            item.add_marker(pytest.mark.xfail(reason=why, strict=True))
