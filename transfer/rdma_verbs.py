"""A thin verbs layer for the ``rdma`` transport, and its pyverbs implementation.

The transport talks to RDMA hardware only through the small interface here
(:class:`Verbs` -> :class:`VerbsDevice` -> :class:`MemoryRegion`,
:class:`CompletionQueue`, :class:`QueuePair`), so its planning, completion and
failover logic can run against a test double on machines without an RDMA
device. :class:`PyverbsVerbs` is the real implementation over rdma-core's
``pyverbs`` (imported lazily, on first use).

Numbers follow libibverbs (``enum ibv_wr_opcode``, ``enum ibv_wc_status``,
``enum ibv_mtu``, ``enum ibv_access_flags``) so they pass to pyverbs unchanged.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

__all__ = [
    "MTU_BYTES",
    "Access",
    "Completion",
    "CompletionQueue",
    "MemoryRegion",
    "PortInfo",
    "PyverbsVerbs",
    "QpState",
    "QueuePair",
    "RemoteQp",
    "Sge",
    "Verbs",
    "VerbsDevice",
    "VerbsError",
    "WcStatus",
    "WorkRequest",
    "WrOp",
    "build_send_wr",
    "connect_attr",
    "mtu_enum",
    "pyverbs_modules",
    "qp_init_attr",
    "valid_gid",
]

log = logging.getLogger(__name__)


class WrOp(IntEnum):
    """``enum ibv_wr_opcode`` values the transport posts."""

    RDMA_WRITE = 0
    RDMA_READ = 4


class WcStatus(IntEnum):
    """``enum ibv_wc_status``."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21

    @classmethod
    def name_of(cls, value: int) -> str:
        try:
            return cls(value).name
        except ValueError:
            return f"status {value}"


class QpState(IntEnum):
    """``enum ibv_qp_state``."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class Access(IntFlag):
    """``enum ibv_access_flags`` (the ones used here)."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4


#: ``enum ibv_mtu`` value -> bytes
MTU_BYTES: dict[int, int] = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_MTU_ENUM = {v: k for k, v in MTU_BYTES.items()}
_GID_RE = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")


def mtu_enum(nbytes: int) -> int:
    """``ibv_mtu`` enum value for a path MTU in bytes (256..4096, power of two)."""
    try:
        return _MTU_ENUM[nbytes]
    except KeyError:
        raise ValueError(f"MTU must be one of {sorted(_MTU_ENUM)}, got {nbytes}") from None


def valid_gid(gid: str) -> bool:
    """True for pyverbs' GID text form ``xxxx:xxxx:...`` (8 groups of 4 hex digits)."""
    return bool(_GID_RE.match(gid))


class VerbsError(Exception):
    """A verbs call failed (device, registration, QP modify, post). ``errno``
    is the OS error where the verbs library gave one."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True, slots=True)
class Sge:
    """One scatter/gather element: ``length`` bytes at local ``addr`` under ``lkey``."""

    addr: int
    length: int
    lkey: int


@dataclass(slots=True)
class WorkRequest:
    """One signalled RDMA WRITE/READ: the local SGE list <-> ``length`` bytes at
    ``remote_addr`` (under ``rkey``) of the peer the QP is connected to."""

    wr_id: int
    op: WrOp
    sges: list[Sge]
    remote_addr: int
    rkey: int

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sges)


@dataclass(frozen=True, slots=True)
class Completion:
    """One work completion: ``status`` is a :class:`WcStatus` value."""

    wr_id: int
    status: int
    vendor_err: int = 0
    qp_num: int = 0

    @property
    def ok(self) -> bool:
        return self.status == WcStatus.SUCCESS


@dataclass(frozen=True, slots=True)
class PortInfo:
    """What a peer needs to address this port: ``lid`` (InfiniBand; 0 on
    RoCE), ``gid`` at the configured GID index, active ``mtu`` in bytes."""

    lid: int
    gid: str
    mtu: int
    link_layer: str = "InfiniBand"


@dataclass(frozen=True, slots=True)
class RemoteQp:
    """The remote end of a connection as RTR needs it."""

    qp_num: int
    psn: int
    lid: int
    gid: str
    mtu: int


class MemoryRegion(ABC):
    """A registered memory range (``addr``, ``length``) with its keys."""

    addr: int
    length: int
    lkey: int
    rkey: int

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length

    @abstractmethod
    def close(self) -> None:
        """Deregister. Idempotent."""


class CompletionQueue(ABC):
    @abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """Up to ``max_entries`` completions, [] when none is ready (never blocks)."""

    @abstractmethod
    def close(self) -> None:
        """Destroy. Idempotent."""


class QueuePair(ABC):
    """An RC queue pair. Connect with :meth:`connect` (INIT -> RTR -> RTS)."""

    qp_num: int
    psn: int

    @abstractmethod
    def connect(self, remote: RemoteQp, mtu: int, max_rd_atomic: int) -> None:
        """Move RESET/INIT -> INIT -> RTR -> RTS towards ``remote``; ``mtu`` is
        the path MTU in bytes (the smaller of both ends). Raises VerbsError."""

    @abstractmethod
    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        """Post signalled work requests (in order). Raises VerbsError if the
        send queue is full or the QP cannot accept them."""

    @abstractmethod
    def to_error(self) -> None:
        """Move to ERR: outstanding WRs complete with WR_FLUSH_ERR."""

    @property
    @abstractmethod
    def state(self) -> QpState: ...

    @abstractmethod
    def close(self) -> None:
        """Destroy (no WR is processed afterwards). Idempotent."""


class VerbsDevice(ABC):
    """An opened device + port + protection domain."""

    name: str
    port: int
    gid_index: int
    max_sge: int
    max_qp_wr: int
    max_rd_atomic: int

    @abstractmethod
    def port_info(self) -> PortInfo:
        """LID, GID (at ``gid_index``) and active MTU of the port."""

    @abstractmethod
    def reg_mr(self, addr: int, length: int, access: Access) -> MemoryRegion:
        """Register ``[addr, addr+length)`` (host memory, or device memory where
        a peer-memory client such as nvidia-peermem is loaded)."""

    @abstractmethod
    def create_cq(self, depth: int) -> CompletionQueue: ...

    @abstractmethod
    def create_qp(self, cq: CompletionQueue, depth: int, max_sge: int,
                  access: Access) -> QueuePair:
        """An RC QP on ``cq`` (send and receive), ``depth`` send WRs, moved to
        INIT with ``access`` as its remote access flags."""

    @abstractmethod
    def close(self) -> None:
        """Close the PD and the device context. Idempotent."""


class Verbs(ABC):
    """Entry point: which devices exist, open one."""

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, "") when at least one device can be opened, else (False, reason)."""

    @abstractmethod
    def device_names(self) -> list[str]: ...

    @abstractmethod
    def open(self, name: str, port: int, gid_index: int) -> VerbsDevice: ...


# -- pyverbs ---------------------------------------------------------------------


def _import_pyverbs() -> tuple[dict[str, Any] | None, str]:
    try:
        import pyverbs.device as pdev
        import pyverbs.enums as penums
        from pyverbs.addr import GID as PGID
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR
    except ImportError as exc:
        return None, f"pyverbs not importable ({exc}); install the rdma extra (docs/rdma.md)"
    return {
        "device": pdev, "e": penums, "AHAttr": AHAttr, "GlobalRoute": GlobalRoute,
        "GID": PGID, "CQ": CQ, "MR": MR, "PD": PD, "PyverbsError": PyverbsError, "QP": QP,
        "QPAttr": QPAttr, "QPCap": QPCap, "QPInitAttr": QPInitAttr, "SGE": SGE,
        "SendWR": SendWR,
    }, ""


def _errno(exc: BaseException) -> int:
    return int(getattr(exc, "error_code", 0) or 0)


_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def connect_attr(pv: dict[str, Any], port: int, gid_index: int, access: Access,
                 remote: RemoteQp, mtu: int, max_rd_atomic: int, psn: int) -> Any:
    """The pyverbs ``QPAttr`` for INIT -> RTR -> RTS of an RC QP towards
    ``remote`` (global route when the remote has a GID, LID routing else)."""
    attr = pv["QPAttr"](port_num=port)
    attr.qp_access_flags = int(access)
    attr.pkey_index = 0
    attr.path_mtu = mtu_enum(mtu)
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = max_rd_atomic
    attr.max_rd_atomic = max_rd_atomic
    attr.min_rnr_timer = 12
    attr.timeout = 14       # 4.096 us * 2^14 ~ 67 ms per transport retry
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    if remote.gid and remote.gid != _ZERO_GID:
        gr = pv["GlobalRoute"](dgid=pv["GID"](remote.gid), sgid_index=gid_index)
        ah = pv["AHAttr"](dlid=remote.lid, is_global=1, port_num=port, gr=gr)
    else:  # InfiniBand without GRH: LID routing
        ah = pv["AHAttr"](dlid=remote.lid, port_num=port)
    attr.ah_attr = ah
    return attr


def qp_init_attr(pv: dict[str, Any], cq: Any, depth: int, max_sge: int) -> Any:
    """``QPInitAttr`` of an RC QP on ``cq`` (send and receive): ``depth`` send
    WRs of ``max_sge`` SGEs, one receive slot (RDMA READ/WRITE need none), and
    completions only for signalled WRs (we signal every one)."""
    e = pv["e"]
    cap = pv["QPCap"](max_send_wr=depth, max_recv_wr=1, max_send_sge=max_sge, max_recv_sge=1)
    return pv["QPInitAttr"](qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def build_send_wr(pv: dict[str, Any], wr: WorkRequest) -> Any:
    """The pyverbs ``SendWR`` (signalled, RDMA WRITE/READ, SGE list, remote
    address and rkey) for ``wr``."""
    e = pv["e"]
    opcode = e.IBV_WR_RDMA_WRITE if wr.op == WrOp.RDMA_WRITE else e.IBV_WR_RDMA_READ
    sges = [pv["SGE"](s.addr, s.length, s.lkey) for s in wr.sges]
    swr = pv["SendWR"](wr_id=wr.wr_id, opcode=opcode, num_sge=len(sges), sg=sges,
                       send_flags=e.IBV_SEND_SIGNALED)
    swr.set_wr_rdma(wr.rkey, wr.remote_addr)
    return swr


def pyverbs_modules() -> tuple[dict[str, Any] | None, str]:
    """The pyverbs names the real verbs layer uses, or (None, why not)."""
    return _import_pyverbs()


class _PvMR(MemoryRegion):
    def __init__(self, mr: Any, addr: int, length: int) -> None:
        self._mr = mr
        self.addr = addr
        self.length = length
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)

    def close(self) -> None:
        mr, self._mr = self._mr, None
        if mr is not None:
            mr.close()


class _PvCQ(CompletionQueue):
    def __init__(self, cq: Any) -> None:
        self._cq = cq

    def poll(self, max_entries: int) -> list[Completion]:
        _n, wcs = self._cq.poll(max_entries)
        return [Completion(int(w.wr_id), int(w.status), int(w.vendor_err), int(w.qp_num))
                for w in wcs]

    def close(self) -> None:
        cq, self._cq = self._cq, None
        if cq is not None:
            cq.close()


class _PvQP(QueuePair):
    def __init__(self, pv: dict[str, Any], dev: _PvDevice, qp: Any, psn: int,
                 access: Access) -> None:
        self._pv = pv
        self._dev = dev
        self._qp = qp
        self._access = access
        self.qp_num = int(qp.qp_num)
        self.psn = psn

    @property
    def state(self) -> QpState:
        return QpState(int(self._qp.qp_state))

    def connect(self, remote: RemoteQp, mtu: int, max_rd_atomic: int) -> None:
        pv = self._pv
        try:
            attr = connect_attr(pv, self._dev.port, self._dev.gid_index, self._access, remote,
                                mtu, max_rd_atomic, self.psn)
            # pyverbs applies the RC attribute masks of each transition
            if self.state == QpState.RESET:
                self._qp.to_init(attr)
            self._qp.to_rtr(attr)
            self._qp.to_rts(attr)
        except pv["PyverbsError"] as exc:
            raise VerbsError(f"QP {self.qp_num} connect: {exc}", _errno(exc)) from exc

    def post_send(self, wrs: Sequence[WorkRequest]) -> None:
        pv = self._pv
        for wr in wrs:
            swr = build_send_wr(pv, wr)
            try:
                self._qp.post_send(swr)
            except pv["PyverbsError"] as exc:
                raise VerbsError(f"post_send on QP {self.qp_num}: {exc}", _errno(exc)) from exc

    def to_error(self) -> None:
        pv, e = self._pv, self._pv["e"]
        try:
            attr = pv["QPAttr"]()
            attr.qp_state = e.IBV_QPS_ERR
            self._qp.modify(attr, e.IBV_QP_STATE)
        except pv["PyverbsError"] as exc:
            raise VerbsError(f"QP {self.qp_num} -> ERR: {exc}", _errno(exc)) from exc

    def close(self) -> None:
        qp, self._qp = self._qp, None
        if qp is not None:
            qp.close()


class _PvDevice(VerbsDevice):
    def __init__(self, pv: dict[str, Any], name: str, port: int, gid_index: int) -> None:
        self._pv = pv
        self.name = name
        self.port = port
        self.gid_index = gid_index
        self._lock = threading.Lock()
        try:
            self._ctx = pv["device"].Context(name=name)
            attr = self._ctx.query_device()
            self.max_sge = int(attr.max_sge)
            self.max_qp_wr = int(attr.max_qp_wr)
            # responder (max_dest_rd_atomic) and initiator (max_rd_atomic) limits
            self.max_rd_atomic = max(1, min(16, int(attr.max_qp_rd_atom),
                                            int(attr.max_qp_init_rd_atom)))
            self._pd = pv["PD"](self._ctx)
        except pv["PyverbsError"] as exc:
            raise VerbsError(f"open {name}: {exc}", _errno(exc)) from exc
        self._psn = 0

    def port_info(self) -> PortInfo:
        pv = self._pv
        try:
            pa = self._ctx.query_port(self.port)
            gid = str(self._ctx.query_gid(self.port, self.gid_index))
        except pv["PyverbsError"] as exc:
            raise VerbsError(f"query port {self.port} of {self.name}: {exc}",
                             _errno(exc)) from exc
        link = "Ethernet" if int(getattr(pa, "link_layer", 1)) == 2 else "InfiniBand"
        return PortInfo(lid=int(pa.lid), gid=gid, mtu=MTU_BYTES.get(int(pa.active_mtu), 1024),
                        link_layer=link)

    def reg_mr(self, addr: int, length: int, access: Access) -> MemoryRegion:
        try:
            mr = self._pv["MR"](self._pd, length, int(access), address=addr)
        except self._pv["PyverbsError"] as exc:
            raise VerbsError(f"register {length} bytes at {addr:#x}: {exc}",
                             _errno(exc)) from exc
        return _PvMR(mr, addr, length)

    def create_cq(self, depth: int) -> CompletionQueue:
        try:
            return _PvCQ(self._pv["CQ"](self._ctx, depth))
        except self._pv["PyverbsError"] as exc:
            raise VerbsError(f"create CQ of {depth}: {exc}", _errno(exc)) from exc

    def create_qp(self, cq: CompletionQueue, depth: int, max_sge: int,
                  access: Access) -> QueuePair:
        pv = self._pv
        assert isinstance(cq, _PvCQ)
        try:
            qp = pv["QP"](self._pd, qp_init_attr(pv, cq._cq, depth, max_sge))
            attr = pv["QPAttr"](port_num=self.port)
            attr.qp_access_flags = int(access)
            attr.pkey_index = 0
            qp.to_init(attr)
        except pv["PyverbsError"] as exc:
            raise VerbsError(f"create RC QP: {exc}", _errno(exc)) from exc
        return _PvQP(pv, self, qp, secrets.randbelow(1 << 24), access)

    def close(self) -> None:
        with self._lock:
            pd, self._pd = getattr(self, "_pd", None), None
            ctx, self._ctx = getattr(self, "_ctx", None), None
        if pd is not None:
            pd.close()
        if ctx is not None:
            ctx.close()


@dataclass
class PyverbsVerbs(Verbs):
    """The real verbs layer over rdma-core's pyverbs (lazy import)."""

    _pv: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _reason: str = field(default="", init=False)

    def _load(self) -> dict[str, Any] | None:
        if self._pv is None and not self._reason:
            self._pv, self._reason = _import_pyverbs()
        return self._pv

    def device_names(self) -> list[str]:
        """Names of the RDMA devices; [] when none (pyverbs raises then)."""
        pv = self._load()
        if pv is None:
            return []
        try:
            devs = pv["device"].get_device_list()
        except pv["PyverbsError"] as exc:
            # with no device (or no kernel support) get_device_list raises
            log.debug("get_device_list: %s", exc)
            return []
        names = []
        for d in devs:
            n = d.name
            names.append(n.decode() if isinstance(n, bytes) else str(n))
        return names

    def available(self) -> tuple[bool, str]:
        pv = self._load()
        if pv is None:
            return False, self._reason
        try:
            devs = pv["device"].get_device_list()
        except pv["PyverbsError"] as exc:
            return False, f"no RDMA device ({exc})"
        if not devs:
            return False, "no RDMA device"
        return True, ""

    def open(self, name: str, port: int, gid_index: int) -> VerbsDevice:
        pv = self._load()
        if pv is None:
            raise VerbsError(self._reason)
        return _PvDevice(pv, name, port, gid_index)
