"""Busy is not dead: a stalled segment owner keeps its segment and objects.

A real process owns a segment with 50 objects and stalls in the three ways a
serving process does -- pure-Python CPU work beside a CPU hog, one C call
that holds the GIL, SIGSTOP (a debugger, a frozen job) -- for longer than the
master's client TTL each; afterwards all 50 objects read back byte for byte.
The master's grace is short here (0.5 s), so only the owner's guard process
(heartbeats from outside the stalled interpreter) can keep the data: the
control test runs the same stall without a guard and sees the segment dropped.
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

from kvpool.cluster.processes import MasterProcess
from kvpool.core.errors import ErrorCode
from kvpool.core.protocol import ListSegments, Stats, StatsReply
from kvpool.store import Client, ClientConfig

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from lifecycle_holder import value  # noqa: E402

TTL_S = 1.0
GRACE_S = 0.5
KEYS = 50
SIZE = 64 * 1024


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    with MasterProcess(client_ttl_s=TTL_S,
                       extra_args=["--client-grace-s", str(GRACE_S)]) as m:
        yield m


@pytest.fixture
def hog() -> Iterator[None]:
    """A second CPU-bound process on the host for the whole test."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    p.kill()
    p.wait(10)


class Holder:
    def __init__(self, master: MasterProcess, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "lifecycle_holder.py"), "--master", master.address,
             "--mode", "commands", "--keys", str(KEYS), "--size", str(SIZE),
             "--ping-interval", "0.2", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.recv(60)
        self.segment_id = self.info["segment_ids"][0]

    def recv(self, timeout_s: float) -> dict[str, Any]:
        out: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None
        t = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        assert out and out[0], f"holder silent (exit {self.proc.poll()})"
        reply: dict[str, Any] = json.loads(out[0])
        return reply

    def call(self, line: str, timeout_s: float = 60) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.recv(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            try:
                self.call("quit", timeout_s=15)
            except (AssertionError, OSError):
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _state(master: MasterProcess, seg: str) -> str | None:
    with master.client() as mc:
        for s in mc.call(ListSegments()).segments:
            if s.descriptor.segment_id == seg:
                return s.state
    return None


def _wait_state(master: MasterProcess, seg: str, want: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := _state(master, seg)) != want:
        assert time.monotonic() < deadline, f"segment {seg} is {got}, expected {want}"
        time.sleep(0.05)


def _read_all(reader: Client) -> list[int]:
    """Per key: 1 = the right bytes, 0 = other bytes, -code = an error."""
    out = []
    for i, got in enumerate(reader.get_batch([f"k{i}" for i in range(KEYS)])):
        out.append(-1 if got is None else int(got == value(i, SIZE)))
    return out


def _stats(master: MasterProcess) -> StatsReply:
    with master.client() as mc:
        return mc.call(Stats())


@pytest.fixture
def reader(master: MasterProcess) -> Iterator[Client]:
    with Client(ClientConfig(master_address=master.address, ping_interval_s=0.2)) as c:
        yield c


def test_stalled_owner_keeps_its_segment_and_objects(master: MasterProcess, hog: None,
                                                     reader: Client) -> None:
    before = _stats(master)
    h = Holder(master, "--memory", str(8 << 20))
    try:
        assert _read_all(reader) == [1] * KEYS
        # 1) pure-Python CPU work beside a CPU hog, 3x the TTL
        assert h.call(f"busy {3 * TTL_S}") == {"busy": True}
        # 2) one C call holding the GIL for 1.5x the TTL: no thread of the holder runs
        assert h.call(f"gil {1.5 * TTL_S}") == {"gil": True}
        # 3) SIGSTOP for 2x the TTL: the client is suspect (no new placements)...
        os.kill(h.proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        _wait_state(master, h.segment_id, "suspect", timeout_s=4 * TTL_S)
        # ... but its memory is there: a same-host reader still gets every byte
        assert _read_all(reader) == [1] * KEYS
        time.sleep(max(0.0, 2 * TTL_S - (time.monotonic() - t_stop)))
        assert _state(master, h.segment_id) == "suspect"  # past TTL + grace: kept
        os.kill(h.proc.pid, signal.SIGCONT)
        _wait_state(master, h.segment_id, "active", timeout_s=10)
        assert _read_all(reader) == [1] * KEYS
        assert h.call("state") == {"remounts": 0}  # kept, not re-mounted empty
        after = _stats(master)
        assert after.revived_clients > before.revived_clients
        assert after.expired_clients == before.expired_clients
    finally:
        h.close()


def test_without_guard_a_stall_past_the_grace_loses_the_segment(master: MasterProcess,
                                                                reader: Client) -> None:
    """The control: the same SIGSTOP without a guard outlasts TTL + grace."""
    h = Holder(master, "--memory", str(8 << 20), "--no-guard")
    try:
        assert h.info["guard_pid"] is None
        assert _read_all(reader) == [1] * KEYS
        os.kill(h.proc.pid, signal.SIGSTOP)
        _wait_state(master, h.segment_id, None, timeout_s=TTL_S + GRACE_S + 5)
        os.kill(h.proc.pid, signal.SIGCONT)
        # the owner is back: it re-mounts, empty
        _wait_state(master, h.segment_id, "active", timeout_s=10)
        assert h.call("state")["remounts"] >= 1
        assert set(_read_all(reader)) == {-1}
        assert not reader.exists("k0")
        assert reader.get_batch(["k0"]) == [None]
        with pytest.raises(Exception) as ei:
            reader.get("k0")
        assert getattr(ei.value, "code", None) == ErrorCode.OBJECT_NOT_FOUND
    finally:
        h.close()
