"""The ``rdma`` transport against real pyverbs (marked ``rdma``).

Skips with the reason where pyverbs is not importable; the end-to-end test
also needs an RDMA device (none exists on the machines this was written on,
so the hardware data path has not run; see docs/rdma.md). Where pyverbs is
importable but no device exists, the availability test checks the documented
fact that ``get_device_list()`` raises and the transport says why.

To run with Debian 12's pyverbs: ``apt-get install python3-pyverbs`` and put
only the package on the path, e.g. ``mkdir /tmp/pv && ln -s
/usr/lib/python3/dist-packages/pyverbs /tmp/pv/ && PYTHONPATH=/tmp/pv pytest
-m rdma tests/transfer/test_rdma_pyverbs.py`` (same Python minor version).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from kvpool.transfer import (
    MemorySegment,
    RequestState,
    TransferEngine,
    TransferOp,
    TransferRequest,
    load_transfer_config,
)
from kvpool.transfer.config import TransportSettings
from kvpool.transfer.rdma_verbs import (
    MTU_BYTES,
    Access,
    PyverbsVerbs,
    QpState,
    RemoteQp,
    Sge,
    WcStatus,
    WorkRequest,
    WrOp,
    build_send_wr,
    connect_attr,
    mtu_enum,
    pyverbs_modules,
    qp_init_attr,
)
from kvpool.transfer.transports.rdma import RdmaTransport

pytestmark = pytest.mark.rdma


def _pyverbs() -> Any:
    try:
        import pyverbs.enums as e
    except ImportError as exc:
        pytest.skip(f"pyverbs not importable ({exc}); see docs/rdma.md")
    return e


def test_our_verbs_numbers_match_pyverbs() -> None:
    """The verbs layer passes these numbers to pyverbs unchanged."""
    e = _pyverbs()
    assert WrOp.RDMA_WRITE == e.IBV_WR_RDMA_WRITE and WrOp.RDMA_READ == e.IBV_WR_RDMA_READ
    for st in WcStatus:
        assert int(st) == getattr(e, f"IBV_WC_{st.name}"), st
    for qs in QpState:
        assert int(qs) == getattr(e, f"IBV_QPS_{qs.name}"), qs
    for a in Access:
        assert int(a) == getattr(e, f"IBV_ACCESS_{a.name}"), a
    for enum_v, nbytes in MTU_BYTES.items():
        assert enum_v == getattr(e, f"IBV_MTU_{nbytes}") == mtu_enum(nbytes)


def test_pyverbs_objects_of_post_send_and_connect_build_without_a_device() -> None:
    """SendWR/SGE/GlobalRoute/AHAttr/QPAttr need no device: build exactly what
    post_send and connect build, with real pyverbs, and read them back."""
    e = _pyverbs()
    pv, reason = pyverbs_modules()
    assert pv is not None, reason
    wr = WorkRequest(7, WrOp.RDMA_READ, [Sge(0x2000, 4096, 0x11), Sge(0x9000, 512, 0x11)],
                     0x1000, 0x55)
    swr = build_send_wr(pv, wr)
    assert swr.wr_id == 7 and swr.num_sge == 2 and swr.opcode == e.IBV_WR_RDMA_READ
    assert swr.send_flags == e.IBV_SEND_SIGNALED
    gid = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    remote = RemoteQp(qp_num=0x1234, psn=99, lid=0, gid=gid, mtu=4096)
    access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
    attr = connect_attr(pv, 1, 3, access, remote, 2048, 16, 4242)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (0x1234, 99, 4242)
    assert attr.path_mtu == e.IBV_MTU_2048 and attr.qp_access_flags == int(access)
    assert attr.max_rd_atomic == attr.max_dest_rd_atomic == 16
    assert attr.ah_attr.is_global and attr.ah_attr.dgid == gid
    assert attr.ah_attr.sgid_index == 3 and attr.ah_attr.port_num == 1
    ib = connect_attr(pv, 2, 0, access, RemoteQp(5, 1, 17, "0000:0000:0000:0000:0000:0000:"
                                                 "0000:0000", 4096), 4096, 1, 1)
    assert not ib.ah_attr.is_global and ib.ah_attr.dlid == 17 and ib.ah_attr.port_num == 2
    init = qp_init_attr(pv, None, 128, 4)
    assert init.qp_type == e.IBV_QPT_RC and init.cap.max_send_wr == 128
    assert init.cap.max_send_sge == 4 and init.sq_sig_all == 0


def test_availability_reports_why_with_real_pyverbs() -> None:
    _pyverbs()
    ok, reason = PyverbsVerbs().available()
    t = RdmaTransport()
    try:
        assert t.available() == (ok, reason)
    finally:
        t.close()
    if not ok:
        # the documented fact: with no device get_device_list() raises, and we say so
        assert reason.startswith("no RDMA device"), reason
        assert PyverbsVerbs().device_names() == []


def test_write_read_over_a_real_device() -> None:
    """Two engines in this process, one RDMA device, real RC QPs."""
    _pyverbs()
    ok, reason = PyverbsVerbs().available()
    if not ok:
        pytest.skip(f"needs an RDMA device: {reason}")
    settings = TransportSettings(timeout_s=10.0, options={"qp_depth": 16,
                                                           "max_wr_bytes": "256KiB"})
    settings.validate()
    a = TransferEngine(load_transfer_config(), "host-a", client_id="a")
    b = TransferEngine(load_transfer_config(), "host-b", client_id="b")
    seg = MemorySegment.create(f"rdma-hw-{uuid.uuid4().hex[:8]}", 4 << 20)
    try:
        ra, rb = RdmaTransport(settings), RdmaTransport(settings)
        a.register_transport(ra, settings)
        b.register_transport(rb, settings)
        desc = b.add_local_segment(seg)
        desc.extra.update(rb.describe_segment(seg))
        a.add_peer_segment(desc)
        data = np.frombuffer(np.random.default_rng(8).bytes(3 << 20), dtype=np.uint8).copy()
        h = a.register_buffer(data)
        [st] = a.transfer([TransferRequest(TransferOp.WRITE, h, seg.segment_id, 0,
                                           data.nbytes)], timeout=20)
        assert st.state is RequestState.DONE and st.transport == "rdma", st.errors
        assert np.array_equal(seg.array()[:data.nbytes], data)
        out = np.zeros_like(data)
        [st] = a.transfer([TransferRequest(TransferOp.READ, out, seg.segment_id, 0,
                                           data.nbytes)], timeout=20)
        assert st.ok and st.transport == "rdma", st.errors
        assert np.array_equal(out, data)
    finally:
        a.close()
        b.close()
        seg.close()
