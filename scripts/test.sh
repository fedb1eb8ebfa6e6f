#!/usr/bin/env bash
# Lint, types and the whole test suite (GPU tests skip themselves where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite starts about a thousand Python processes (controllers, agents, workers, CLIs). With
# PYTHONDONTWRITEBYTECODE set (as on the dev and CI machines) each one compiled every gpupool
# module it imports again: a quarter of a second of CPU for a controller. Compile them once.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m compileall -q -j 0 src tests >/dev/null
.venv/bin/ruff check src tests bench
.venv/bin/mypy
# Most of the suite waits on real processes (controllers, agents, workers), so four xdist
# workers keep it inside its 15-minute budget even on two cores; worksteal evens out the long
# end-to-end tests. GPUPOOL_TEST_WORKERS=0 runs it in one process.
# Its timeouts and waits stretch by the slowdown factor it measures at start (the header's
# "gpupool slowdown" line; GPUPOOL_TEST_SLOWDOWN=N sets it), so it stays green on a loaded
# machine: `bash scripts/stress.sh bash scripts/test.sh` proves it (docs/testing.md).
workers=${GPUPOOL_TEST_WORKERS:-4}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest --durations=15 "$@"
fi
for arg in "$@"; do
  case $arg in -*) ;; *) exec .venv/bin/python -m pytest -n "$workers" --dist worksteal --durations=15 "$@" ;; esac
done
# The whole suite. tests/k8s/real shares one real Kubernetes control plane (a minute to
# start) among its tests: it runs in one process of its own after the rest, not once per
# xdist worker.
.venv/bin/python -m pytest -n "$workers" --dist worksteal --durations=15 --ignore=tests/k8s/real "$@"
exec .venv/bin/python -m pytest -p no:xdist --durations=10 tests/k8s/real "$@"
