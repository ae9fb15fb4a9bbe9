"""The guard process reads typed messages and never dies of its input.

Each test drives a real guard (``python -m kvpool.store.guard``, spawned by
the parent-side :class:`Guard`) with what a parent may send: a close before
any spec (the parent's setup failed after it spawned the guard), lines that
are not messages, a spec then a close. The guard must end with its exit
status, write no traceback, and leave the shared memory it was told about to
its owner (this process); nothing of the test stays in /dev/shm.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.store.guard import Guard, GuardSpec
from kvpool.transfer.segment import SHM_DIR, shm_tag_prefix

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shm_file() -> Iterator[str]:
    """A /dev/shm file of this test (no ``.seg``: no janitor touches it)."""
    name = f"{shm_tag_prefix()}guard-input-{uuid.uuid4().hex[:8]}"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    yield name
    if os.path.exists(path):
        os.unlink(path)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(name)], "shm leaked"


def _spawn(tmp_path: Path) -> tuple[Guard, Path]:
    err = tmp_path / "guard.err"
    with open(err, "wb") as f:
        guard = Guard.spawn(stderr=f)
    return guard, err


def _spec(shm_name: str) -> GuardSpec:
    # nothing listens at the master address: heartbeats fail (logged at debug)
    return GuardSpec(parent_pid=os.getpid(), client_id="guard-input-test",
                     master_address="127.0.0.1:1", rpc_timeout_s=0.5, interval_s=0.2,
                     shm={"seg-0": shm_name})


def _send(guard: Guard, data: bytes) -> None:
    guard._send(data)


def _ended(guard: Guard, err: Path, status: int) -> str:
    """The guard's exit status is ``status``; its stderr (no traceback)."""
    assert guard.proc.wait(10) == status
    text = err.read_text(errors="replace")
    assert "Traceback" not in text, text
    return text


def test_close_before_spec_ends_quietly(tmp_path: Path) -> None:
    guard, err = _spawn(tmp_path)
    guard.close()  # what a parent whose setup failed does
    assert _ended(guard, err, 0) == ""


def test_bad_lines_are_skipped_with_a_warning(tmp_path: Path, shm_file: str) -> None:
    guard, err = _spawn(tmp_path)
    try:
        for line in (b"not json", b'{"op": "bogus"}', b'{"no": "op"}', b"\xff\xfe",
                     b'{"op": "spec", "parent_pid": "nope"}', b"[1, 2]"):
            _send(guard, line + b"\n")
        guard.start(_spec(shm_file))  # the guard still takes its spec ...
        assert guard.ready(10)
        _send(guard, b"garbage after the spec\n")
        _send(guard, b'{"op": "spec", "parent_pid": 1, "client_id": "x", "master_address": '
                     b'"127.0.0.1:1", "rpc_timeout_s": 1, "interval_s": 1}\n')
        time.sleep(0.2)
        assert guard.alive()  # ... and outlives bad lines and a second spec
    finally:
        guard.close()
    text = _ended(guard, err, 0)
    assert text.count("WARNING") == 8, text
    assert "line skipped" in text and "a second spec ignored" in text
    assert os.path.exists(os.path.join(SHM_DIR, shm_file))  # the owner's to release


def test_spec_then_close(tmp_path: Path, shm_file: str) -> None:
    guard, err = _spawn(tmp_path)
    guard.start(_spec(shm_file))
    assert guard.ready(10)
    guard.close()
    assert _ended(guard, err, 0) == ""
    assert os.path.exists(os.path.join(SHM_DIR, shm_file))  # released by its owner, not here


def test_spec_and_close_in_one_write(tmp_path: Path, shm_file: str) -> None:
    guard, err = _spawn(tmp_path)
    guard.start(_spec(shm_file))
    guard.close()  # both lines may reach the guard in one read
    _ended(guard, err, 0)


def test_eof_before_spec_after_garbage(tmp_path: Path) -> None:
    guard, err = _spawn(tmp_path)
    _send(guard, b"{truncated")  # no newline: never a message
    guard._sock.close()  # the parent let go without a word
    text = _ended(guard, err, 1)
    assert "WARNING" not in text
    if guard.proc.stdout is not None:
        guard.proc.stdout.close()
