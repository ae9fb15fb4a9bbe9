"""Fidelity of LoopbackVerbsDouble (tests/support/verbs_double.py), the fake of
RDMA hardware this machine lacks: it must keep the rules of real RC verbs
that the rdma transport depends on."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.transfer.rdma_verbs import (
    Access,
    QpState,
    RemoteQp,
    Sge,
    VerbsError,
    WcStatus,
    WorkRequest,
    WrOp,
)
from support.verbs_double import (
    ENOMEM,
    LoopbackFabric,
    LoopbackVerbsDouble,
    _DCq,
    _DDevice,
    _DQp,
)


def _pair(fabric: LoopbackFabric, depth: int = 4) -> tuple[_DDevice, _DDevice, _DQp, _DQp, _DCq]:
    v = LoopbackVerbsDouble(fabric)
    a, b = v.open("loop0", 1, 0), v.open("loop0", 1, 0)
    assert isinstance(a, _DDevice) and isinstance(b, _DDevice)
    cqa, cqb = a.create_cq(16), b.create_cq(16)
    acc = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
    qa, qb = a.create_qp(cqa, depth, 4, acc), b.create_qp(cqb, depth, 4, acc)
    ia, ib = a.port_info(), b.port_info()
    assert isinstance(qa, _DQp) and isinstance(qb, _DQp) and isinstance(cqa, _DCq)
    qb.connect(RemoteQp(qa.qp_num, qa.psn, ia.lid, ia.gid, ia.mtu), 4096, 16)
    qa.connect(RemoteQp(qb.qp_num, qb.psn, ib.lid, ib.gid, ib.mtu), 4096, 16)
    return a, b, qa, qb, cqa


def test_double_moves_bytes_and_checks_keys() -> None:
    fab = LoopbackFabric()
    a, b, qa, _qb, cq = _pair(fab)
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    lmr = a.reg_mr(int(src.ctypes.data), 256, Access.LOCAL_WRITE)
    rmr = b.reg_mr(int(dst.ctypes.data), 256, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    qa.post_send([WorkRequest(1, WrOp.RDMA_WRITE,
                              [Sge(lmr.addr, 100, lmr.lkey), Sge(lmr.addr + 100, 156, lmr.lkey)],
                              rmr.addr, rmr.rkey)])
    assert [c.status for c in cq.poll(8)] == [WcStatus.SUCCESS]
    assert np.array_equal(src, dst)
    # READ needs REMOTE_READ on the target: refused, and the QP is then in ERR
    qa.post_send([WorkRequest(2, WrOp.RDMA_READ, [Sge(lmr.addr, 16, lmr.lkey)], rmr.addr,
                              rmr.rkey)])
    assert [c.status for c in cq.poll(8)] == [WcStatus.REM_ACCESS_ERR]
    assert qa.state == QpState.ERR
    qa.post_send([WorkRequest(3, WrOp.RDMA_WRITE, [Sge(lmr.addr, 16, lmr.lkey)], rmr.addr,
                              rmr.rkey)])
    assert [c.status for c in cq.poll(8)] == [WcStatus.WR_FLUSH_ERR]


def test_double_enforces_depth_stale_rkeys_and_flush() -> None:
    fab = LoopbackFabric()
    a, b, qa, _qb, cq = _pair(fab, depth=2)
    buf = np.zeros(64, dtype=np.uint8)
    lmr = a.reg_mr(int(buf.ctypes.data), 64, Access.LOCAL_WRITE)
    rmr = b.reg_mr(int(buf.ctypes.data), 64, Access.REMOTE_WRITE | Access.REMOTE_READ)
    fab.stall = True

    def wr(i: int) -> WorkRequest:
        return WorkRequest(i, WrOp.RDMA_WRITE, [Sge(lmr.addr, 8, lmr.lkey)], rmr.addr, rmr.rkey)

    qa.post_send([wr(1), wr(2)])
    with pytest.raises(VerbsError) as ei:
        qa.post_send([wr(3)])
    assert ei.value.errno == ENOMEM
    assert cq.poll(8) == []  # held: nothing completes while stalled
    qa.to_error()
    assert [c.status for c in cq.poll(8)] == [WcStatus.WR_FLUSH_ERR] * 2
    # a deregistered (stale) rkey is a remote access error on a fresh QP pair
    fab.stall = False
    a2, b2, qa2, _, cq2 = _pair(fab)
    l2 = a2.reg_mr(int(buf.ctypes.data), 64, Access.LOCAL_WRITE)
    r2 = b2.reg_mr(int(buf.ctypes.data), 64, Access.REMOTE_WRITE)
    r2.close()
    qa2.post_send([WorkRequest(9, WrOp.RDMA_WRITE, [Sge(l2.addr, 8, l2.lkey)], r2.addr,
                               r2.rkey)])
    assert [c.status for c in cq2.poll(8)] == [WcStatus.REM_ACCESS_ERR]


def test_double_refuses_post_before_rts_and_bad_local_keys() -> None:
    fab = LoopbackFabric()
    v = LoopbackVerbsDouble(fab)
    d = v.open("loop0", 1, 0)
    cq = d.create_cq(4)
    qp = d.create_qp(cq, 4, 1, Access.LOCAL_WRITE)
    with pytest.raises(VerbsError):
        qp.post_send([WorkRequest(1, WrOp.RDMA_WRITE, [Sge(1, 1, 1)], 1, 1)])
    _a, b, qa, _qb, cqa = _pair(fab)
    buf = np.zeros(8, dtype=np.uint8)
    rmr = b.reg_mr(int(buf.ctypes.data), 8, Access.REMOTE_WRITE)
    # an lkey of another device is a local protection error
    qa.post_send([WorkRequest(1, WrOp.RDMA_WRITE, [Sge(rmr.addr, 8, rmr.lkey)], rmr.addr,
                              rmr.rkey)])
    assert [c.status for c in cqa.poll(4)] == [WcStatus.LOC_PROT_ERR]
