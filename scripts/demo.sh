#!/usr/bin/env bash
# The pool's main job on the embedded default: controller, agent and a real workload through a lease.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gpupool demo "$@"
