#!/usr/bin/env bash
# Makes .venv with gpupool and everything it needs; quick when it is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
fi
stamp=.venv/.gpupool-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q -e '.[dev]' 2>&1 | grep -v -i 'warning' || true
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v -i 'warning' || true  # pinned: the CPU wheel
  .venv/bin/python -c 'import gpupool.controller.app, gpupool.cli.main' # fail here, not later
  touch "$stamp"
fi
