"""GPU buffers through shm and tcp (skipped where no CUDA device exists).

The full GPU check with bandwidths is scripts/gpu_check_transfer.py (run on
the H200 by the lead); these are the correctness cases for pytest.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from kvpool.transfer import TransferOp, TransferRequest, as_buffer
from kvpool.transfer.gpu import cuda_available, cuda_runtime

_ok, _reason = cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ok, reason=_reason or "no CUDA device")]


def _libs() -> list[str]:
    out = []
    for name in ("torch", "cupy"):
        try:
            mod = __import__(name)
            if (name == "torch" and mod.cuda.is_available()) or \
                    (name == "cupy" and mod.cuda.is_available()):
                out.append(name)
        except Exception:
            pass
    return out


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_gpu_roundtrip(make_engine: Any, make_peer: Any, lib: str, transport: str) -> None:
    if lib not in _libs():
        pytest.skip(f"{lib} with CUDA is not importable")
    n = (5 << 20) + 3
    peer = make_peer(8 << 20, host_id="host-test")
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    if lib == "torch":
        import torch

        src = torch.from_numpy(data).cuda()
        dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    else:
        import cupy

        src = cupy.asarray(data)
        dst = cupy.zeros(n, dtype=cupy.uint8)
    hs = as_buffer(src)
    assert hs.is_gpu
    st = e.transfer([TransferRequest(TransferOp.WRITE, src, peer.segment_id, 4093, n,
                                     transport=transport)], 30)
    assert st[0].ok, st
    assert peer.crc(4093, n) == zlib.crc32(data)
    st = e.transfer([TransferRequest(TransferOp.READ, dst, peer.segment_id, 4093, n,
                                     transport=transport)], 30)
    assert st[0].ok, st
    back = dst.cpu().numpy() if lib == "torch" else dst.get()
    assert (back == data).all()


def test_selector_picks_shm_for_same_host_gpu(make_engine: Any, make_peer: Any) -> None:
    rt, _ = cuda_runtime()
    assert rt is not None
    peer = make_peer(1 << 20, host_id="host-test")
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    shm = e.transport("shm")
    assert shm is not None and shm.supports(peer.desc.kind, True, "cuda")


def test_direct_gpu_shm_copies(make_engine: Any, make_peer: Any) -> None:
    """GPU <-> same-host shm through the engine on a real GPU: adjacent ranges
    merged, others apart, both ways."""
    if "torch" not in _libs():
        pytest.skip("torch with CUDA is not importable")
    import torch

    peer = make_peer(8 << 20, host_id="host-test")
    e = make_engine("host-test")
    e.add_peer_segment(peer.desc)
    n = 1 << 20
    data = np.random.default_rng(9).integers(0, 256, 3 * n, dtype=np.uint8)
    src = torch.from_numpy(data).cuda()
    hs = [as_buffer(src[k * n:(k + 1) * n]) for k in range(3)]
    offs = [0, n, 5 * n]  # objects 0 and 1 adjacent in the segment
    st = e.transfer([TransferRequest(TransferOp.WRITE, h, peer.segment_id, o, n)
                     for h, o in zip(hs, offs, strict=True)], 10)
    assert all(x.ok and x.transport == "shm" for x in st), st
    for k, o in enumerate(offs):
        assert peer.crc(o, n) == zlib.crc32(data[k * n:(k + 1) * n].tobytes())
    dst = torch.zeros(3 * n, dtype=torch.uint8, device="cuda")
    hd = [as_buffer(dst[k * n:(k + 1) * n]) for k in range(3)]
    st = e.run([TransferRequest(TransferOp.READ, h, peer.segment_id, o, n)
                for h, o in zip(hd, offs, strict=True)], 10)
    assert all(x.ok and x.transport == "shm" for x in st), st
    assert torch.equal(dst, src)
