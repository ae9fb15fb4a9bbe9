"""Fixtures of the connector tests. vLLM tests need the `vllm` extra
(scripts/install_vllm.sh) and are marked ``vllm``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tiny_model, engine_proc

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None

needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm not importable: install the vllm extra (scripts/install_vllm.sh)"
)
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="torch not importable: it comes with the vllm extra"
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama with a locally trained tokenizer (built once)."""
    if not HAVE_VLLM:
        pytest.skip("vllm not importable")
    from tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tinyllama")))
