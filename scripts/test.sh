#!/usr/bin/env bash
# Set up .venv and run every check CI runs: ruff, mypy, the test suite, then
# the vLLM end-to-end tests in their own step (the `vllm` extra).
# KVPOOL_SKIP_VLLM=1 skips that last step.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The chaos suite needs `ip` and `tc` (iproute2); install it where we can.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null 2>&1 || true
fi
# tests/deploy runs a real Prometheus (the Debian package brings prometheus and
# promtool; no PyPI package ships them); skipped with a reason where it is absent.
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 || true
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e '.[test]'
bash scripts/lint.sh
.venv/bin/python -m pytest -q --durations=25 -m "not vllm" tests
# 1-minute soak: RSS, fd and shm-file growth under churn (scripts/soak.py --minutes 10 for the full run)
mkdir -p out
.venv/bin/python scripts/soak.py --minutes 1 --json out/soak_ci.json
if [ "${KVPOOL_SKIP_VLLM:-0}" != 1 ] && [ -d tests/connector ]; then
  bash scripts/install_vllm.sh
  # torch CPU tensors as transfer buffers, and the Mooncake tensor API (torch
  # arrives with the vllm extra)
  .venv/bin/python -m pytest -q -k torch tests/transfer/test_buffers.py tests/transfer/test_engine.py
  .venv/bin/python -m pytest -q tests/store/test_mooncake_tensor.py
  # the SGLang HiCache backend's replay of SGLang's calls (host pools are torch tensors)
  .venv/bin/python -m pytest -q tests/integrations
  .venv/bin/python -m pytest -q -m vllm tests/connector
fi
