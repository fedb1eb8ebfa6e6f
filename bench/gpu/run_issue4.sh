#!/usr/bin/env bash
# On the GPU machine: remote leases' isolation, then remote/local step times; results to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
timeout 200 python3 bench/remote_isolation.py 2>&1 | tail -40
cp bench/results/remote_isolation.json "$OUT/" 2>/dev/null
pkill -f nvidia-cuda-mps-control; pkill -f nvidia-cuda-mps-server; pkill -f gpupool.worker
timeout 330 python3 bench/remote_overhead.py --steps 15 --timeout 120 2>&1 | tail -30
cp bench/results/remote_overhead.json "$OUT/" 2>/dev/null
pkill -f gpupool.worker; ps aux | grep -c "[n]vidia-cuda-mps" || true
