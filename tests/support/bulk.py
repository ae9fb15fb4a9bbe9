"""Raw bulk-stream exchanges for the transfer tests: frames written by hand
on a plain TCP socket, replies split as they come back."""

from __future__ import annotations

import socket
from typing import Any

from kvpool.transfer import wire

__all__ = ["exchange", "frame", "split_reply"]


def frame(msg: Any) -> bytes:
    """``msg`` as a bulk-stream frame (length prefix, then the encoding)."""
    raw = wire.encode(msg)
    return len(raw).to_bytes(4, "little") + raw


def exchange(host: str, port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection, end our side, and read until the
    server closes (a reset after it closed with our bytes unread ends it too)."""
    with socket.create_connection((host, port), timeout=5) as c:
        c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
        except ConnectionResetError:  # closed with our bytes unread: a reset
            pass
        return out


def split_reply(out: bytes) -> tuple[wire.BulkReply, bytes]:
    """The first reply frame of ``out`` and what follows it (its data, more frames)."""
    n = int.from_bytes(out[:4], "little")
    return wire.decode_bulk_reply(out[4:4 + n]), out[4 + n:]
