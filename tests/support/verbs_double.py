"""LoopbackVerbsDouble: a fake of RDMA hardware this machine lacks.

No machine here has an RDMA device, so the ``rdma`` transport's planning,
completion handling and failover run against this double of the verbs layer
(:mod:`kvpool.transfer.rdma_verbs`). It keeps the rules of real RC verbs that
the transport depends on:

- WRs only post on an RTS QP; more than the QP's send depth outstanding
  (completions not yet polled) is refused (ENOMEM);
- every SGE must lie inside a local MR of the same device (else LOC_PROT_ERR,
  a READ also needs LOCAL_WRITE), the remote range inside a live MR of the
  connected peer's device with REMOTE_WRITE / REMOTE_READ (else
  REM_ACCESS_ERR; a deregistered MR is a stale rkey), and the remote QP must
  exist and be RTR/RTS (else RETRY_EXC_ERR, as when no responder answers);
- after an error completion the QP is in ERR and every later or held WR
  completes with WR_FLUSH_ERR; to_error() flushes held WRs.

The bytes really move: a WR is a ``ctypes.memmove`` between the registered
regions (both ends live in this process). Faults: ``fabric.fail_next(n,
status, skip)`` fails WRs, ``fabric.stall = True`` holds WRs (never
completing) until the QP goes to ERR.

Its fidelity is checked by tests/transfer/test_rdma_double.py.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.transfer.rdma_verbs import (
    MTU_BYTES,
    Access,
    Completion,
    CompletionQueue,
    MemoryRegion,
    PortInfo,
    QpState,
    QueuePair,
    RemoteQp,
    Verbs,
    VerbsDevice,
    VerbsError,
    WcStatus,
    WorkRequest,
    WrOp,
    valid_gid,
)

__all__ = ["LoopbackFabric", "LoopbackVerbsDouble"]

ENOMEM = 12
EFAULT = 14
EINVAL = 22


@dataclass
class LoopbackFabric:
    """Shared state of every double device in this process (the 'wire')."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    mrs: dict[int, _DMr] = field(default_factory=dict)
    qps: dict[int, _DQp] = field(default_factory=dict)
    stall: bool = False
    #: ranges reg_mr refuses with EFAULT, like device memory without a
    #: peer-memory client (nvidia-peermem)
    unregistrable: list[tuple[int, int]] = field(default_factory=list)
    max_outstanding_seen: int = 0
    wrs_executed: int = 0
    sge_counts: list[int] = field(default_factory=list)
    _faults: deque[tuple[int, int]] = field(default_factory=deque)  # (skip, status)
    _keys: itertools.count[int] = field(default_factory=lambda: itertools.count(0x1000))
    _qpns: itertools.count[int] = field(default_factory=lambda: itertools.count(0x100))

    def fail_next(self, count: int, status: WcStatus = WcStatus.RETRY_EXC_ERR,
                  skip: int = 0) -> None:
        """Fail ``count`` WRs with ``status`` after letting ``skip`` WRs through."""
        with self.lock:
            for i in range(count):
                self._faults.append((skip if i == 0 else 0, int(status)))

    def _take_fault(self) -> int | None:
        if not self._faults:
            return None
        skip, status = self._faults[0]
        if skip > 0:
            self._faults[0] = (skip - 1, status)
            return None
        self._faults.popleft()
        return status

    def execute(self, qp: _DQp, wr: WorkRequest) -> int:
        """Run one WR from ``qp``; returns the completion status."""
        fault = self._take_fault()
        if fault is not None:
            return fault
        for s in wr.sges:
            mr = self.mrs.get(s.lkey)
            if mr is None or mr.dev != qp.dev.index or not mr.covers(s.addr, s.length):
                return WcStatus.LOC_PROT_ERR
            if wr.op == WrOp.RDMA_READ and not mr.access & Access.LOCAL_WRITE:
                return WcStatus.LOC_PROT_ERR
        remote = self.qps.get(qp.remote_qpn)
        if remote is None or remote.state not in (QpState.RTR, QpState.RTS):
            return WcStatus.RETRY_EXC_ERR
        rmr = self.mrs.get(wr.rkey)
        need = Access.REMOTE_WRITE if wr.op == WrOp.RDMA_WRITE else Access.REMOTE_READ
        if rmr is None or rmr.dev != remote.dev.index or not rmr.covers(wr.remote_addr,
                                                                         wr.length) \
                or not rmr.access & need:
            return WcStatus.REM_ACCESS_ERR
        raddr = wr.remote_addr
        for s in wr.sges:
            if wr.op == WrOp.RDMA_WRITE:
                ctypes.memmove(raddr, s.addr, s.length)
            else:
                ctypes.memmove(s.addr, raddr, s.length)
            raddr += s.length
        self.wrs_executed += 1
        self.sge_counts.append(len(wr.sges))
        return WcStatus.SUCCESS


class _DMr(MemoryRegion):
    """A registration: the range, its keys, its device and access (the
    fabric's table holds these until closed)."""

    def __init__(self, fabric: LoopbackFabric, key: int, addr: int, length: int, dev: int,
                 access: Access) -> None:
        self._fabric = fabric
        self.addr, self.length, self.lkey, self.rkey = addr, length, key, key
        self.dev = dev
        self.access = access

    def close(self) -> None:
        with self._fabric.lock:
            self._fabric.mrs.pop(self.lkey, None)


class _DCq(CompletionQueue):
    def __init__(self, fabric: LoopbackFabric, depth: int) -> None:
        self._fabric = fabric
        self.depth = depth
        self.queue: deque[tuple[Completion, _DQp]] = deque()
        self.closed = False

    def poll(self, max_entries: int) -> list[Completion]:
        out = []
        with self._fabric.lock:
            while self.queue and len(out) < max_entries:
                c, qp = self.queue.popleft()
                qp.outstanding -= 1
                out.append(c)
        return out

    def close(self) -> None:
        self.closed = True


class _DQp(QueuePair):
    def __init__(self, dev: _DDevice, cq: _DCq, depth: int, max_sge: int,
                 access: Access) -> None:
        self.dev = dev
        self.cq = cq
        self.depth = depth
        self.max_sge = max_sge
        self.access = access
        self._state = QpState.INIT
        self.qp_num = next(dev.fabric._qpns)
        self.psn = (self.qp_num * 7919) & 0xFFFFFF
        self.remote_qpn = 0
        self.outstanding = 0
        self.held: list[WorkRequest] = []
        dev.fabric.qps[self.qp_num] = self

    @property
    def state(self) -> QpState:
        return self._state

    def connect(self, remote: RemoteQp, mtu: int, max_rd_atomic: int) -> None:
        with self.dev.fabric.lock:
            if self._state not in (QpState.RESET, QpState.INIT):
                raise VerbsError(f"QP {self.qp_num}: connect from {self._state.name}", EINVAL)
            if mtu not in MTU_BYTES.values() or not valid_gid(remote.gid) \
                    or not 0 < remote.qp_num < 1 << 24 or max_rd_atomic < 1:
                raise VerbsError(f"QP {self.qp_num}: bad RTR attributes", EINVAL)
            self.remote_qpn = remote.qp_num
            self._state = QpState.RTS

    def _complete(self, wr: WorkRequest, status: int) -> None:
        self.cq.queue.append((Completion(wr.wr_id, status, 0, self.qp_num), self))
        if status not in (WcStatus.SUCCESS, WcStatus.WR_FLUSH_ERR):
            self._state = QpState.ERR

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        fab = self.dev.fabric
        with fab.lock:
            if self._state not in (QpState.RTS, QpState.ERR):
                raise VerbsError(f"QP {self.qp_num}: post_send in {self._state.name}", EINVAL)
            if self.outstanding + len(wrs) > self.depth:
                raise VerbsError(f"QP {self.qp_num}: send queue full ({self.depth})", ENOMEM)
            for wr in wrs:
                if not 1 <= len(wr.sges) <= self.max_sge:
                    raise VerbsError(f"QP {self.qp_num}: {len(wr.sges)} SGEs", EINVAL)
                self.outstanding += 1
                fab.max_outstanding_seen = max(fab.max_outstanding_seen, self.outstanding)
                if self._state == QpState.ERR:
                    self._complete(wr, WcStatus.WR_FLUSH_ERR)
                elif fab.stall:
                    self.held.append(wr)
                else:
                    self._complete(wr, fab.execute(self, wr))

    def to_error(self) -> None:
        with self.dev.fabric.lock:
            self._state = QpState.ERR
            held, self.held = self.held, []
            for wr in held:
                self._complete(wr, WcStatus.WR_FLUSH_ERR)

    def close(self) -> None:
        with self.dev.fabric.lock:
            self._state = QpState.RESET
            self.held.clear()
            self.dev.fabric.qps.pop(self.qp_num, None)


class _DDevice(VerbsDevice):
    def __init__(self, fabric: LoopbackFabric, index: int, name: str, port: int,
                 gid_index: int) -> None:
        self.fabric = fabric
        self.index = index
        self.name = name
        self.port = port
        self.gid_index = gid_index
        self.max_sge = 8
        self.max_qp_wr = 1024
        self.max_rd_atomic = 16
        self.closed = False

    def port_info(self) -> PortInfo:
        gid = "fe80:0000:0000:0000:0000:0000:0000:" + f"{self.index:04x}"
        return PortInfo(lid=self.index, gid=gid, mtu=4096)

    def reg_mr(self, addr: int, length: int, access: Access) -> MemoryRegion:
        if addr <= 0 or length <= 0:
            raise VerbsError(f"reg_mr({addr:#x}, {length})", EINVAL)
        for start, n in self.fabric.unregistrable:
            if addr < start + n and start < addr + length:
                raise VerbsError(f"reg_mr({addr:#x}, {length}): Bad address", EFAULT)
        with self.fabric.lock:
            key = next(self.fabric._keys)
            mr = self.fabric.mrs[key] = _DMr(self.fabric, key, addr, length, self.index,
                                             Access(access))
        return mr

    def create_cq(self, depth: int) -> CompletionQueue:
        return _DCq(self.fabric, depth)

    def create_qp(self, cq: CompletionQueue, depth: int, max_sge: int,
                  access: Access) -> QueuePair:
        assert isinstance(cq, _DCq)
        if depth > self.max_qp_wr or max_sge > self.max_sge:
            raise VerbsError("QP caps exceed the device's", EINVAL)
        with self.fabric.lock:
            return _DQp(self, cq, depth, max_sge, access)

    def close(self) -> None:
        self.closed = True


class LoopbackVerbsDouble(Verbs):
    """Test double of the verbs layer (see module doc). Each ``open()`` makes a
    new device on the shared ``fabric`` (its own LID/GID and keys space)."""

    _devs = itertools.count(1)

    def __init__(self, fabric: LoopbackFabric | None = None,
                 devices: Sequence[str] = ("loop0",)) -> None:
        self.fabric = fabric or LoopbackFabric()
        self.devices = list(devices)
        self.opened: list[_DDevice] = []

    def available(self) -> tuple[bool, str]:
        if not self.devices:
            return False, "no RDMA device (loopback double configured without devices)"
        return True, ""

    def device_names(self) -> list[str]:
        return list(self.devices)

    def open(self, name: str, port: int, gid_index: int) -> VerbsDevice:
        if name not in self.devices:
            raise VerbsError(f"no device {name}")
        dev = _DDevice(self.fabric, next(self._devs), name, port, gid_index)
        self.opened.append(dev)
        return dev


# -- tests of the double's fidelity ------------------------------------------------------
