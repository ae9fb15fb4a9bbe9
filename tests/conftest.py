"""Suite-wide setup: this run's shared-memory files carry their own tag.

Test runs share this host (/dev/shm) but never a master. The lifecycle tests
orphan segments on purpose and check that *their* janitor removes them and
unmounts them at *their* master; a janitor of another run (a node daemon
reaps every 2 s) that got there first would free the file without the
unmount. With ``KVPOOL_SHM_TAG`` set here (inherited by every process the
tests start), each run's janitors reap only the run's own orphans. Orphans of
runs that died are removed at session start. (Janitors of versions before
tags reap only ``kvpool-*`` names: tagged ``kvpool~...`` files are safe from
them too.)
"""

from __future__ import annotations

import os
import re

import pytest

_TAG = f"pytest{os.getpid()}"
os.environ["KVPOOL_SHM_TAG"] = _TAG
_TAG_NAME = re.compile(r"^kvpool~pytest(\d+)~")


def pytest_sessionstart(session: pytest.Session) -> None:
    from kvpool.transfer.segment import SHM_DIR, reap_orphaned_shm

    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    dead = set()
    for name in names:
        m = _TAG_NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            dead.add(m.group(1))
        except PermissionError:
            pass
    for pid in dead:
        reap_orphaned_shm(prefix=f"kvpool~pytest{pid}~")
