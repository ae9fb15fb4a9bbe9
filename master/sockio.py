"""Non-blocking socket reads and writes, as the master's own socket servers
use them: the direct RPC sockets (:mod:`kvpool.master.local_rpc`) and the
plain-socket transport of replication (:mod:`kvpool.master.ha.transport`).

A would-block is not an error (the next poll says when to go on); any other
``OSError`` means the connection is gone (its owner drops it).
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["recv_some", "send_some"]


def recv_some(sock: socket.socket, buf: Any) -> int:
    """Read what is there into ``buf``: the bytes read; 0 when the peer closed
    or the socket failed (drop it); -1 when nothing is there now."""
    try:
        return sock.recv_into(buf)
    except (BlockingIOError, InterruptedError):
        return -1
    except OSError:
        return 0


def send_some(sock: socket.socket, data: Any) -> int:
    """Send what the kernel takes now: the bytes sent (0: none now, e.g. not
    connected yet or its buffer full); -1 when the socket failed (drop it)."""
    try:
        return sock.send(data)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:
        return -1
