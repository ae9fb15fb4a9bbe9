"""The master loop's poller: ``zmq.Poller``'s interface at a fraction of its cost.

``zmq.Poller.poll`` (``zmq_poll``) polls every registered descriptor once
without waiting, then again with the timeout, and before and after each pass
asks every ZeroMQ socket for its ``EVENTS`` (a ``getpid(2)`` and a
``poll(2)`` of the socket's mailbox inside libzmq): six system calls per
loop turn even when every request comes over the direct RPC sockets and the
ROUTER socket is idle. This poller makes one ``poll(2)`` over the plain
descriptors and the ZeroMQ sockets' mailbox descriptors (``zmq.FD``), and
asks a ZeroMQ socket for ``EVENTS`` only when its mailbox descriptor is
readable or when it may hold messages that no longer signal:

- A socket registered ``lazy`` is asked before waiting only after its owner
  called :meth:`touch` (it received or sent on it since the last poll). The
  mailbox descriptor signals only for commands that arrive after the last
  time libzmq processed its commands, and a recv or send may process them
  (then messages can be queued with the descriptor quiet); an ``EVENTS``
  query that says "nothing to read" leaves the socket in the signalling
  state again.
- Any other ZeroMQ socket is asked before every wait (other code may use it
  at any time), which is what ``zmq_poll`` does.

Plain descriptors are polled by number on every call, as ``zmq_poll`` does
(a descriptor closed and its number reused is still watched). Results are
``(socket or fd, mask)`` with ZeroMQ's POLLIN/POLLOUT/POLLERR bits, ZeroMQ
sockets first in registration order, as ``zmq.Poller`` returns them.
"""

from __future__ import annotations

import select
from typing import Any, cast

import zmq

__all__ = ["LoopPoller"]

# plain ints: enum arithmetic costs ~1 µs per operation on the hot path
_ZIN, _ZOUT, _ZERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)
_EVENTS = int(zmq.EVENTS)
_IN, _OUT, _PRI = select.POLLIN, select.POLLOUT, select.POLLPRI


class _ZSock:
    __slots__ = ("dirty", "fd", "lazy", "mask", "sock")

    def __init__(self, sock: zmq.Socket[Any], mask: int, lazy: bool) -> None:
        self.sock = sock
        self.mask = mask
        self.lazy = lazy
        self.fd = cast(int, sock.get(zmq.FD))
        self.dirty = True  # messages may be queued from before registration


class LoopPoller:
    """``register``/``modify``/``unregister``/``poll`` as ``zmq.Poller``'s
    (timeouts in milliseconds; ``None`` or negative: wait forever), plus
    :meth:`touch` for sockets registered ``lazy``. One thread only."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._zsocks: list[_ZSock] = []  # registration order
        self._zbyfd: dict[int, _ZSock] = {}
        self._fds: dict[int, int] = {}  # fd -> zmq mask

    def register(self, what: Any, flags: int = _ZIN | _ZOUT, lazy: bool = False) -> None:
        """Watch a ZeroMQ socket or a file descriptor (again: new ``flags``).
        ``lazy`` (ZeroMQ sockets): the owner calls :meth:`touch` after every
        recv or send on it (see the module docstring)."""
        if not flags:
            self.unregister(what)
            return
        if isinstance(what, zmq.Socket):
            for z in self._zsocks:
                if z.sock is what:
                    z.mask = int(flags)
                    z.lazy = lazy
                    z.dirty = True
                    return
            z = _ZSock(what, int(flags), lazy)
            self._zsocks.append(z)
            self._zbyfd[z.fd] = z
            self._poll.register(z.fd, _IN)
            return
        fd = what if isinstance(what, int) else what.fileno()
        mask = (_IN if flags & _ZIN else 0) | (_OUT if flags & _ZOUT else 0)
        self._fds[fd] = int(flags)
        self._poll.register(fd, mask)  # a registered fd is modified

    def modify(self, what: Any, flags: int = _ZIN | _ZOUT) -> None:
        self.register(what, flags)

    def unregister(self, what: Any) -> None:
        """Stop watching; KeyError if it was not registered (as ``zmq.Poller``)."""
        if isinstance(what, zmq.Socket):
            for i, z in enumerate(self._zsocks):
                if z.sock is what:
                    del self._zsocks[i]
                    # (a closed socket's descriptor number may serve another one now)
                    if self._zbyfd.get(z.fd) is z:
                        del self._zbyfd[z.fd]
                        if z.fd not in self._fds:
                            self._poll.unregister(z.fd)
                    return
            raise KeyError(what)
        fd = what if isinstance(what, int) else what.fileno()
        del self._fds[fd]
        self._poll.unregister(fd)

    def touch(self, sock: zmq.Socket[Any]) -> None:
        """``sock`` (registered lazy) was received from or sent on: ask it
        for ``EVENTS`` before the next wait."""
        for z in self._zsocks:
            if z.sock is sock:
                z.dirty = True
                return

    def poll(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        """Wait up to ``timeout`` ms for an event; the ready ``(socket or fd, mask)``."""
        zready: dict[_ZSock, int] | None = None
        for z in self._zsocks:
            if z.dirty or not z.lazy:
                z.dirty = False
                ev = cast(int, z.sock.get(_EVENTS)) & z.mask
                if ev:
                    if zready is None:
                        zready = {}
                    zready[z] = ev
        if zready is not None or timeout is None or timeout < 0:
            wait = 0 if zready is not None else None
        else:
            wait = int(timeout)
        got = self._poll.poll(wait)
        out: list[tuple[Any, int]] = []
        if not got and zready is None:
            return out
        zbyfd = self._zbyfd
        fds = self._fds
        for fd, ev in got:
            zs = zbyfd.get(fd)
            if zs is not None:  # its mailbox signalled: ask it (once per call)
                if zready is None or zs not in zready:
                    zev = cast(int, zs.sock.get(_EVENTS)) & zs.mask
                    if zev:
                        if zready is None:
                            zready = {}
                        zready[zs] = zev
                continue
            want = fds.get(fd)
            if want is None:
                continue
            r = (_ZIN if ev & _IN else 0) | (_ZOUT if ev & _OUT else 0)
            if ev & ~(_IN | _OUT | _PRI):
                r |= _ZERR
            r &= want | _ZERR
            if r:
                out.append((fd, r))
        if zready:
            return [(z.sock, zready[z]) for z in self._zsocks if z in zready] + out
        return out
