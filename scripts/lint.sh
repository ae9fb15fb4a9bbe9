#!/usr/bin/env bash
# ruff + mypy over the project. mypy cannot follow kvpool.* through setuptools'
# editable finder, so it checks a symlink tree that mirrors the installed layout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m ruff check core master store transfer connector cluster tests scripts
tree=.tmp/mypy/kvpool
mkdir -p "$tree"
for layer in core master store transfer connector cluster; do
  ln -sfn "$PWD/$layer" "$tree/$layer"
done
MYPYPATH=.tmp/mypy "$PY" -m mypy --cache-dir .tmp/mypy-cache \
  -p kvpool.core -p kvpool.master -p kvpool.store -p kvpool.transfer -p kvpool.connector \
  -p kvpool.cluster
