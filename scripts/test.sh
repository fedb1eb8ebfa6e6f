#!/usr/bin/env bash
# Lint, types and the whole test suite (GPU tests skip themselves where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests bench
.venv/bin/mypy
exec .venv/bin/python -m pytest --durations=15 "$@"
