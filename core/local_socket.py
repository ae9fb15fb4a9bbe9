"""The file of a master's same-host RPC socket (see :mod:`kvpool.master.local_rpc`):
where a master puts it by default, and removing one a dead master left.

A master killed by SIGKILL cannot unlink its socket file. The next master
on the same port replaces a stale file when it starts; process harnesses
(``kvpool.cluster.processes``, the tests' HA fixture) remove it when they
clean up after a master they killed. A file some process still listens on
is never removed.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile

__all__ = ["default_socket_path", "remove_stale_socket"]

# connect() errors that mean no one listens there (or the file is no socket)
_STALE = (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)


def default_socket_path(port: int) -> str:
    """``$TMPDIR/kvpool-master-<uid>-<port>.sock``."""
    return os.path.join(tempfile.gettempdir(), f"kvpool-master-{os.getuid()}-{port}.sock")


def remove_stale_socket(path: str, timeout_s: float = 0.5) -> bool:
    """Unlink ``path`` when no process listens on it (a connect is refused).

    Returns True when ``path`` is gone (it was stale, or absent), False when
    a live process accepted the connect (the file is kept). Raises OSError
    when the probe fails otherwise (e.g. a full backlog times out)."""
    if not os.path.lexists(path):
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout_s)
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in _STALE:
            raise
        try:
            os.unlink(path)  # left behind by a master that died
        except FileNotFoundError:
            pass  # another cleanup got there first
        return True
    finally:
        probe.close()
    return False
