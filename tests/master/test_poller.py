"""Unit: the master loop's poller (master/poller.py) reports what zmq.Poller
reports, for plain descriptors and ZeroMQ sockets (lazy ones after touch()),
and never sleeps through a queued message."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from kvpool.master.poller import LoopPoller

pytestmark = pytest.mark.timeout(60)

IN, OUT, ERR = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLERR)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.term()


def test_plain_descriptors_like_zmq_poller() -> None:
    a, b = socket.socketpair()
    try:
        p, z = LoopPoller(), zmq.Poller()
        for poller in (p, z):
            poller.register(a.fileno(), IN)
        t = time.monotonic()
        assert p.poll(30) == [] and time.monotonic() - t >= 0.02
        b.send(b"x")
        assert p.poll(1000) == z.poll(0) == [(a.fileno(), IN)]
        for poller in (p, z):
            poller.modify(a.fileno(), IN | OUT)
        assert p.poll(0) == z.poll(0) == [(a.fileno(), IN | OUT)]
        for poller in (p, z):
            poller.unregister(a.fileno())
        assert p.poll(0) == z.poll(0) == []
        with pytest.raises(KeyError):
            p.unregister(a.fileno())
        for poller in (p, z):
            poller.register(a, IN)  # an object with fileno(): reported by its fd
        b.close()  # the peer gone: readable (EOF), and a hang-up
        got = p.poll(0)
        assert got == z.poll(0)
        assert got[0][0] == a.fileno() and got[0][1] & IN
    finally:
        a.close()
        b.close()


def test_zmq_sockets_first_and_lazy_ones_after_touch(ctx: zmq.Context[zmq.Socket[bytes]]
                                                     ) -> None:
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    a, b = socket.socketpair()
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        p = LoopPoller()
        p.register(a.fileno(), IN)
        p.register(router, IN, lazy=True)
        assert p.poll(0) == []
        b.send(b"x")
        for i in range(3):
            dealer.send(b"m%d" % i)
        time.sleep(0.3)  # all three reach the ROUTER's queue (ZeroMQ's I/O thread)
        deadline = time.monotonic() + 5
        got = p.poll(5000)
        while len(got) < 2 and time.monotonic() < deadline:
            got = p.poll(100)
        assert got == [(router, IN), (a.fileno(), IN)]  # the ZeroMQ socket first
        router.recv_multipart()  # one of three taken: two stay queued
        p.touch(router)
        assert (router, IN) in p.poll(0)
        while router.get(zmq.EVENTS) & IN:
            router.recv_multipart()
        a.recv(10)
        p.touch(router)
        assert p.poll(0) == []
        p.unregister(router)
        dealer.send(b"late")
        time.sleep(0.05)
        assert p.poll(0) == []
        with pytest.raises(KeyError):
            p.unregister(router)
    finally:
        for s in (router, dealer):
            s.close(0)
        a.close()
        b.close()


def test_no_message_is_slept_through(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A loop as the master's: drain a bounded number, reply, touch; messages
    sent at random moments are each seen without waiting out the timeout."""
    rng = random.Random(7)
    router = ctx.socket(zmq.ROUTER)
    dealers = [ctx.socket(zmq.DEALER) for _ in range(3)]
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        for d in dealers:
            d.connect(f"tcp://127.0.0.1:{port}")
        p = LoopPoller()
        p.register(router, IN, lazy=True)
        sent = received = replies = 0
        for _round in range(300):
            for _ in range(rng.randint(0, 3)):
                rng.choice(dealers).send(b"req")
                sent += 1
            t = time.monotonic()
            events = p.poll(2000 if received < sent else 0)
            if received < sent:
                # something is queued or on its way: never a full timeout
                assert time.monotonic() - t < 1.5
            if events:
                assert events == [(router, IN)]
                p.touch(router)
                for _ in range(rng.randint(1, 4)):  # a drain cut short leaves messages
                    if not router.get(zmq.EVENTS) & IN:
                        break
                    frames = router.recv_multipart()
                    received += 1
                    router.send_multipart([frames[0], b"rep"])
                    p.touch(router)
            for d in dealers:
                while d.get(zmq.EVENTS) & IN:
                    d.recv()
                    replies += 1
        while received < sent:
            assert p.poll(2000), "a queued message was not reported"
            p.touch(router)
            while router.get(zmq.EVENTS) & IN:
                router.recv_multipart()
                received += 1
        assert received == sent > 200
    finally:
        for s in (router, *dealers):
            s.close(0)
