"""GPU buffers <-> file segments (gds and posix staging); skipped without CUDA."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvpool.transfer import TransferOp, TransferRequest
from kvpool.transfer.file_segment import FileSegment
from kvpool.transfer.gpu import cuda_runtime

pytestmark = pytest.mark.gpu

_rt, _why = cuda_runtime()
torch = pytest.importorskip("torch") if _rt is not None else None
if _rt is None:
    pytest.skip(f"no CUDA device: {_why}", allow_module_level=True)


@pytest.mark.parametrize("transport", ["posix", "gds"])
@pytest.mark.parametrize("size", [1, 4097, (4 << 20) + 3, 16 << 20])
def test_gpu_buffer_roundtrip(make_engine, tmp_path, transport, size):
    assert torch is not None
    engine = make_engine()
    usable, why = engine.transports().get(transport, (False, "absent"))
    if not usable:
        pytest.skip(f"{transport} unavailable: {why}")
    seg = FileSegment.open(str(tmp_path), 32 << 20)
    try:
        engine.add_local_segment(seg)
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
        st = engine.transfer([TransferRequest(TransferOp.WRITE, src, seg.segment_id, 4099, size,
                                              transport=transport)], 60)
        assert st[0].ok, st[0].errors
        back = np.empty(size, np.uint8)
        seg.read_into(4099, back)
        assert zlib.crc32(back.data) == zlib.crc32(src.cpu().numpy().data)
        st = engine.transfer([TransferRequest(TransferOp.READ, dst, seg.segment_id, 4099, size,
                                              transport=transport)], 60)
        assert st[0].ok, st[0].errors
        assert bool(torch.equal(src, dst))
    finally:
        seg.close()
