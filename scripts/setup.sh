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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q -e '.[dev]' 2>&1 | grep -v -i 'warning' || true
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v -i 'warning' || true  # pinned: the CPU wheel
  .venv/bin/python -c 'import gpupool.controller.app, gpupool.cli.main' # fail here, not later
  touch "$stamp"
fi
# Run as root, the agent starts workers as the unprivileged user gpupool-worker, which must
# reach the interpreter and this checkout. A Python under a mode-700 home (pyenv in /root) is
# out of its reach: give the folders on those paths the search bit only (no listing, no
# reading of anything that is not already world-readable).
if [ "$(id -u)" = 0 ]; then
  for p in "$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')" "$PWD"; do
    while [ "$p" != / ] && [ -n "$p" ]; do
      [ -d "$p" ] && [ ! -L "$p" ] && chmod o+x "$p" 2>/dev/null || true
      p=$(dirname "$p")
    done
  done
fi
# The client's and the worker's compiled hot paths (optional: without a C compiler the Python
# paths run).
stale=0
for c in src/gpupool/torch/_fastpath.c src/gpupool/worker/_runloop.c; do
  so=$(ls "${c%.c}"*.so 2>/dev/null | head -1)
  if [ -z "$so" ] || [ "$c" -nt "$so" ]; then stale=1; fi
done
if [ "$stale" = 1 ]; then
  .venv/bin/python setup.py -q build_ext --inplace >/dev/null 2>&1 \
    || echo "note: the C hot paths did not build; client and worker run their Python paths" >&2
fi
