#!/usr/bin/env bash
# ruff + mypy over the project. mypy cannot follow kvpool.* through setuptools'
# editable finder, so it checks a symlink tree that mirrors the installed layout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m ruff check master store transfer connector tests scripts
tree=.tmp/mypy/kvpool
mkdir -p "$tree"
for layer in master store transfer connector; do
  ln -sfn "$PWD/$layer" "$tree/$layer"
done
MYPYPATH=.tmp/mypy "$PY" -m mypy --cache-dir .tmp/mypy-cache \
  -p kvpool.master -p kvpool.store -p kvpool.transfer -p kvpool.connector
