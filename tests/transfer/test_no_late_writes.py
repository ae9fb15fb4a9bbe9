"""A batch the caller stopped waiting for never writes into its buffers
afterwards: no retry or failover outlives the caller's deadline, and the
run does not return while a transport still moves bytes of it.

A late READ landing in a buffer the caller has since reused (a freed
``bytes`` object's memory, a KV block handed to another request) is silent
corruption: this is what a chaos run saw as a get returning another key's
bytes after a partition healed."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from kvpool.core.errors import ErrorCode
from kvpool.transfer import RequestState, TransferOp, TransferRequest
from support.peer import freeze

R = TransferOp.READ
KiB, MiB = 1 << 10, 1 << 20


def test_read_timed_out_by_the_caller_never_lands_later(make_engine: Any,
                                                        make_peer: Any) -> None:
    peer = make_peer(4 * MiB, host_id="far-away")
    peer.cmd("fill 5")
    # the transport's own timeout and retry are far longer than the caller's wait
    e = make_engine("host-test", overrides={"transports": {"tcp": {"timeout_s": 30.0,
                                                                   "retries": 2}}})
    e.add_peer_segment(peer.desc)
    warm = np.zeros(4 * KiB, np.uint8)
    assert e.transfer([TransferRequest(R, warm, peer.segment_id, 0, 4 * KiB)], 5)[0].ok
    for size in (4 * KiB, 512 * KiB):  # a lone request and a striped one
        buf = np.zeros(size, np.uint8)
        freeze(peer.proc.pid)  # connected but silent
        try:
            t0 = time.monotonic()
            st = e.run([TransferRequest(R, buf, peer.segment_id, 0, size)], 0.5)
            waited = time.monotonic() - t0
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        assert st[0].state is RequestState.FAILED and st[0].code == ErrorCode.TIMEOUT, (size, st)
        assert waited < 3.0, waited
        time.sleep(1.0)  # the peer serves whatever it was still asked for
        assert not buf.any(), f"{np.count_nonzero(buf)} bytes of a {size}-byte read " \
            "landed after the caller was told it timed out"
    # the peer still serves a fresh read
    buf = np.zeros(512 * KiB, np.uint8)
    assert e.transfer([TransferRequest(R, buf, peer.segment_id, 0, 512 * KiB)], 5)[0].ok
    assert buf.any()
