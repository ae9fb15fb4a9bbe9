"""No segment outlives its owner: every way a segment-owning process can end.

Each test runs a real process (``lifecycle_holder.py``) that owns a shared-
memory segment with objects in it, ends it one way -- close(), a client
dropped without close() (also through the Mooncake class, as SGLang drops
it), interpreter exit, SIGTERM, SIGINT, kill -9, kill -9 of the process and
its guard -- and checks that the /dev/shm file is gone, the master no longer
lists the segment (`kvpool status` shows none), its objects are gone, and no
guard process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.core.errors import KVPoolError
from kvpool.core.protocol import Exist, ListSegments, SegmentInfo
from kvpool.store import Client, ClientConfig, ReplicateConfig
from kvpool.transfer.segment import SHM_TAG_ENV, reap_orphaned_shm, shm_tag_prefix

pytestmark = pytest.mark.timeout(90)

HOLDER = str(Path(__file__).with_name("lifecycle_holder.py"))
BOUND_S = 10.0  # cleanup must be observed within this (it takes well under a second)


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    # a long TTL: nothing here may depend on the master noticing silence
    with MasterProcess(client_ttl_s=60) as m:
        yield m


class Holder:
    """The test's handle on one holder process."""

    def __init__(self, master: MasterProcess, mode: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, HOLDER, "--master", master.address, "--mode", mode, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.line()

    def line(self, timeout_s: float = 60.0) -> dict[str, Any]:
        stdout = self.proc.stdout
        assert stdout is not None
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        assert out and out[0], f"holder said nothing (exit {self.proc.poll()})"
        reply: dict[str, Any] = json.loads(out[0])
        return reply

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    @property
    def shm_paths(self) -> list[str]:
        return [os.path.join("/dev/shm", n) for n in self.info["shm_names"]]

    def close(self) -> None:
        """Kill the holder; its guard releases its segment (then it is killed too
        if it is still there)."""
        self.proc.kill()
        self.proc.wait(10)
        guard = self.info.get("guard_pid")
        deadline = time.monotonic() + BOUND_S
        while guard and _alive(guard) and time.monotonic() < deadline:
            time.sleep(0.05)
        if guard and _alive(guard):
            os.kill(guard, signal.SIGKILL)
        for p in self.shm_paths:
            if os.path.exists(p):
                os.unlink(p)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.close()


def _segments(master: MasterProcess) -> dict[str, SegmentInfo]:
    with master.client() as mc:
        return {s.descriptor.segment_id: s for s in mc.call(ListSegments()).segments}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def assert_released(master: MasterProcess, h: Holder, status_cli: bool = False) -> None:
    """Within BOUND_S: shm files gone, segment unmounted, objects gone, guard gone."""
    deadline = time.monotonic() + BOUND_S
    seg_ids = set(h.info["segment_ids"])
    while True:
        files = [p for p in h.shm_paths if os.path.exists(p)]
        mounted = seg_ids & set(_segments(master))
        guard = h.info["guard_pid"]
        guard_alive = bool(guard) and _alive(guard)
        if not files and not mounted and not guard_alive:
            break
        assert time.monotonic() < deadline, (
            f"after {BOUND_S}s: shm files {files}, still mounted {mounted}, "
            f"guard alive {guard_alive}")
        time.sleep(0.05)
    with master.client() as mc:
        assert mc.call(Exist("k0")).exists is False
    if status_cli:
        out = subprocess.run([sys.executable, "-m", "kvpool.cluster.cli", "status", "--master",
                              master.address], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert not any(s in out.stdout for s in seg_ids), out.stdout
        assert "segments: 0 " in out.stdout, out.stdout


def _fresh(master: MasterProcess, holders: list[Holder], mode: str, *extra: str) -> Holder:
    h = Holder(master, mode, *extra)
    holders.append(h)
    assert all(os.path.exists(p) for p in h.shm_paths)
    assert set(h.info["segment_ids"]) <= set(_segments(master))
    return h


@pytest.mark.parametrize("mode", ["close", "drop", "mooncake-drop"])
def test_close_and_dropped_store_release_while_process_lives(
        master: MasterProcess, holders: list[Holder], mode: str) -> None:
    h = _fresh(master, holders, mode)
    h.go()
    assert h.line() == {"released": True}
    assert h.proc.poll() is None  # released by close()/the finalizer, not by an exit
    assert_released(master, h, status_cli=mode == "drop")
    assert h.proc.stdin is not None
    h.proc.stdin.close()
    assert h.proc.wait(30) == 0


def test_interpreter_exit_without_close(master: MasterProcess, holders: list[Holder]) -> None:
    h = _fresh(master, holders, "exit")
    h.go()
    assert h.proc.wait(30) == 0
    assert_released(master, h)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signals(master: MasterProcess, holders: list[Holder], sig: signal.Signals) -> None:
    h = _fresh(master, holders, "wait")
    assert h.info["guard_pid"] and _alive(h.info["guard_pid"])
    h.proc.send_signal(sig)
    h.proc.wait(30)
    # SIGINT: KeyboardInterrupt -> interpreter exit -> finalizer; SIGTERM's
    # default action and kill -9 run no code at all: the guard releases
    assert_released(master, h, status_cli=sig == signal.SIGKILL)


def test_kill9_of_process_and_guard_then_janitors(master: MasterProcess,
                                                  holders: list[Holder],
                                                  tmp_path: Path) -> None:
    """Both killed: nothing of theirs runs. The next segment-owning process on
    the host removes the orphans at setup; the node daemon does it periodically."""
    first = _fresh(master, holders, "wait")
    os.kill(first.info["guard_pid"], signal.SIGKILL)
    first.proc.kill()
    first.proc.wait(10)
    time.sleep(0.3)
    assert all(os.path.exists(p) for p in first.shm_paths)  # orphaned
    with Client(ClientConfig(master_address=master.address, memory_size=4 << 20)) as c:
        assert_released(master, first)  # its setup's janitor ran
        assert all(os.path.exists(f"/dev/shm/{n}") for n in c.shm_names)
    with NodeDaemonProcess(master.address, "4MiB", log_dir=str(tmp_path / "d")) as d:
        second = _fresh(master, holders, "wait")
        os.kill(second.info["guard_pid"], signal.SIGKILL)
        second.proc.kill()
        second.proc.wait(10)
        assert_released(master, second)  # the daemon's periodic janitor
        assert d.running and set(d.segment_ids) <= set(_segments(master))
        assert "orphaned shared memory" in Path(d.log_path).read_text()


def test_janitor_spares_live_owners_and_foreign_files(master: MasterProcess,
                                                      holders: list[Holder]) -> None:
    h = _fresh(master, holders, "wait")
    legacy = "/dev/shm/kvpool-lifecycle-test-legacy"  # no .seg: an older version's, no lock
    with open(legacy, "wb") as f:
        f.write(b"x")
    try:
        removed = reap_orphaned_shm()
        assert not set(removed) & set(h.info["shm_names"]), removed
        assert "kvpool-lifecycle-test-legacy" not in removed
        assert all(os.path.exists(p) for p in h.shm_paths)
        assert os.path.exists(legacy)
    finally:
        os.unlink(legacy)
    assert set(h.info["segment_ids"]) <= set(_segments(master))


def test_janitor_reaps_only_its_own_tags_orphans(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs sharing a host keep apart: a tagged janitor reaps its tag's orphans
    only, an untagged one untagged orphans only (no lock held: all orphans)."""
    names = {"ours": "kvpool~ours~seg_1-aa.seg", "theirs": "kvpool~theirs~seg_1-bb.seg",
             "untagged": "kvpool-seg_1-cc.seg"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    monkeypatch.setenv(SHM_TAG_ENV, "ours")
    assert shm_tag_prefix() == "kvpool~ours~"
    assert reap_orphaned_shm(str(tmp_path)) == [names["ours"]]
    monkeypatch.delenv(SHM_TAG_ENV)
    assert reap_orphaned_shm(str(tmp_path)) == [names["untagged"]]
    assert sorted(os.listdir(tmp_path)) == [names["theirs"]]
    monkeypatch.setenv(SHM_TAG_ENV, "bad~tag")
    with pytest.raises(KVPoolError):
        shm_tag_prefix()


def test_guard_is_respawned_and_a_forked_child_releases_nothing(master: MasterProcess) -> None:
    with Client(ClientConfig(master_address=master.address, memory_size=4 << 20,
                             ping_interval_s=0.1)) as c:
        host = c.segment_host
        assert host.guard is not None
        first = host.guard.pid
        os.kill(first, signal.SIGKILL)
        host._guard_spawned_at -= 60  # do not wait out the respawn rate limit
        deadline = time.monotonic() + BOUND_S
        while host.guard is None or host.guard.pid == first or not host.guard.ready_s:
            assert time.monotonic() < deadline, "guard not replaced"
            time.sleep(0.05)
        assert host.guard_respawns == 1
        assert all(os.path.exists(f"/dev/shm/{n}") for n in c.shm_names)
        c.put("fork-k", b"v" * 100, ReplicateConfig(preferred_segments=c.segment_ids))
        pid = os.fork()
        if pid == 0:  # the child's copy of the client must not release the parent's
            try:
                c.close()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert all(os.path.exists(f"/dev/shm/{n}") for n in c.shm_names)
        assert c.get("fork-k") == b"v" * 100
        assert set(c.segment_ids) <= set(_segments(master))
