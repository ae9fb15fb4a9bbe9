#!/usr/bin/env bash
# ruff + mypy over the project. mypy cannot follow kvpool.* through setuptools'
# editable finder, so it checks a symlink tree that mirrors the installed layout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m ruff check core master store transfer connector cluster integrations tests scripts
tree=.tmp/mypy/kvpool
mkdir -p "$tree"
for layer in core master store transfer connector cluster integrations; do
  ln -sfn "$PWD/$layer" "$tree/$layer"
done
# The link tree is given as files, named from their base .tmp/mypy: with
# `-p kvpool.core` mypy would take the package from the first search path that
# has it, and an editable install that puts a build/ tree on sys.path wins over
# MYPYPATH (then the `^build/` exclude leaves only the six __init__ files).
MYPYPATH=.tmp/mypy "$PY" -m mypy --cache-dir .tmp/mypy-cache --explicit-package-bases \
  "$tree"/core "$tree"/master "$tree"/store "$tree"/transfer "$tree"/connector "$tree"/cluster "$tree"/integrations
