"""The journal's interval fsync runs off the loop thread: ``maybe_fsync``
returns while the disk is slow, at most one fsync is in flight, it covers
everything written before it started, failures are counted and retried, and
rotation / close do not wait for (or break) an fsync in flight."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.master.config import FsyncPolicy
from kvpool.master.journal import Journal, journal_path, read_journal


def _journal(tmp_path: Path, policy: FsyncPolicy = FsyncPolicy.INTERVAL) -> Journal:
    return Journal(str(tmp_path), 1, policy, interval_s=0.0)


def test_interval_fsync_runs_in_the_background_on_the_real_disk(tmp_path: Path) -> None:
    j = _journal(tmp_path)
    try:
        j.append_many([[1, "k1", 10], [1, "k2", 20]])
        j.commit()
        j.maybe_fsync()
        assert j.wait_fsync()
        assert j.background_fsyncs == 1 and j.fsync_errors == 0
        j.maybe_fsync()  # nothing written since: nothing to do
        assert j.wait_fsync() and j.background_fsyncs == 1
        j.append([1, "k3", 30])
        j.commit()
        j.maybe_fsync()
        assert j.wait_fsync() and j.background_fsyncs == 2
        assert threading.current_thread().name != "kvpool-journal-fsync"
    finally:
        j.close()
    records, torn = read_journal(journal_path(str(tmp_path), 1), truncate=False)
    assert records == [[1, "k1", 10], [1, "k2", 20], [1, "k3", 30]] and not torn
    assert not any(t.name == "kvpool-journal-fsync" for t in threading.enumerate())


def test_slow_disk_never_blocks_the_loop(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled fsync (the disk, simulated) keeps the loop going; the next
    interval's fsync waits for it instead of piling up; a failure is counted
    and the data is fsync'ed again at the next interval."""
    release = threading.Event()
    calls: list[tuple[str, int]] = []
    real_fsync = os.fsync
    fail = [False]

    def slow_fsync(fd: int) -> None:
        calls.append((threading.current_thread().name, fd))
        if threading.current_thread().name == "kvpool-journal-fsync":
            assert release.wait(10)
            if fail[0]:
                raise OSError(5, "injected I/O error")
        real_fsync(fd)

    j = _journal(tmp_path)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    try:
        j.append([1, "a", 1])
        j.commit()
        t0 = time.monotonic()
        j.maybe_fsync()  # starts the background fsync, which stalls
        j.append([1, "b", 2])
        j.commit()  # the loop keeps writing meanwhile
        j.maybe_fsync()  # one in flight: no second one
        assert time.monotonic() - t0 < 1.0
        assert len([c for c in calls if c[0] == "kvpool-journal-fsync"]) <= 1
        release.set()
        assert j.wait_fsync()
        bg = [c for c in calls if c[0] == "kvpool-journal-fsync"]
        assert len(bg) == 1 and j.background_fsyncs == 1
        j.maybe_fsync()  # "b" came after the first one started: synced now
        assert j.wait_fsync() and j.background_fsyncs == 2
        # a failing fsync: counted, and the next interval tries again
        fail[0] = True
        j.append([1, "c", 3])
        j.commit()
        j.maybe_fsync()
        assert j.wait_fsync() and j.fsync_errors == 1 and j.background_fsyncs == 2
        fail[0] = False
        j.maybe_fsync()  # nothing new was written, but the failed one is retried
        assert j.wait_fsync() and j.background_fsyncs == 3
    finally:
        release.set()
        j.close()
    records, _ = read_journal(journal_path(str(tmp_path), 1), truncate=False)
    assert [r[1] for r in records] == ["a", "b", "c"]


def test_rotation_and_close_with_an_fsync_in_flight(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        if threading.current_thread().name == "kvpool-journal-fsync":
            started.set()
            assert release.wait(10)
        real_fsync(fd)

    j = _journal(tmp_path)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    try:
        j.append([1, "x", 1])
        j.commit()
        j.maybe_fsync()
        assert started.wait(10)
        assert j.rotate(2, sync=True) == -1  # the loop's own fsync + close: not blocked
        j.append([1, "y", 2])
        j.commit()
        release.set()
        assert j.wait_fsync() and j.background_fsyncs == 1
    finally:
        release.set()
        j.close()
    got: list[Any] = []
    for seq in (1, 2):
        got += read_journal(journal_path(str(tmp_path), seq), truncate=False)[0]
    assert [r[1] for r in got] == ["x", "y"]


def test_always_policy_stays_synchronous(tmp_path: Path) -> None:
    j = _journal(tmp_path, FsyncPolicy.ALWAYS)
    try:
        j.append([1, "k", 1])
        j.commit()  # fsync'ed here, before any reply could leave
        j.maybe_fsync()
        assert j.background_fsyncs == 0 and not any(
            t.name == "kvpool-journal-fsync" for t in threading.enumerate())
    finally:
        j.close()
