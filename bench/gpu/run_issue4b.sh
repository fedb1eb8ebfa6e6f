#!/usr/bin/env bash
# On the GPU machine, second pass: MPS isolation through the shared harness, remote step times
# (blocking reads, then with socket polling); results to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
timeout 200 python3 bench/remote_overhead.py --steps 15 --timeout 100 2>&1 | grep '^{' | cut -c1-400
cp bench/results/remote_overhead.json "$OUT/" 2>/dev/null
pkill -f gpupool.worker
timeout 150 python3 bench/remote_overhead.py --steps 15 --timeout 80 --only resnet50,round_trip,gpt2 --spin-us 200 --out "$OUT/remote_overhead_spin.json" 2>&1 | grep '^{' | cut -c1-300
pkill -f gpupool.worker
timeout 170 python3 bench/mps_isolation.py --seconds 15 2>&1 | grep -E '^(split|memory|physical|wrote)' | cut -c1-300
cp bench/results/mps_isolation.json "$OUT/" 2>/dev/null
pkill -f nvidia-cuda-mps-control; pkill -f nvidia-cuda-mps-server; pkill -f gpupool.worker
ps aux | grep -c "[n]vidia-cuda-mps" || true
