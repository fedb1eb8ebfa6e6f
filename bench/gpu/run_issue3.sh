#!/usr/bin/env bash
# On the GPU machine: GPU tests, then the MPS isolation benchmark; results go to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
which nvidia-cuda-mps-control
python3 -m pytest -q -p no:cacheprovider tests/agent/test_gpu_machine.py tests/agent/test_nvml_backend.py tests/agent/test_mps.py 2>&1 | tail -15
timeout 420 python3 bench/mps_isolation.py --seconds 20 2>&1 | tail -40
cp bench/results/mps_isolation.json "$OUT/" 2>/dev/null
# Leave no MPS daemon behind, whatever happened above.
pkill -f nvidia-cuda-mps-control; pkill -f nvidia-cuda-mps-server; sleep 1
ps aux | grep -c "[n]vidia-cuda-mps" || true
