#!/usr/bin/env bash
# On the GPU machine: the device plugin's Allocate answers held to their slices by MPS
# (bench/k8s_mps_allocate.py); results go to $OUT. Needs grpcio>=1.85.1 and protobuf>=7.35.1
# among the wheels of .whl/ (the agent extra now has them).
set -uo pipefail
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
timeout -k 5 300 python3 bench/k8s_mps_allocate.py --seconds 20 > "$OUT/k8s_mps_allocate.log" 2>&1
echo "k8s_mps_allocate rc=$?" >> "$OUT/k8s_mps_allocate.log"
cp bench/results/k8s_mps_allocate.json "$OUT/" 2>/dev/null
# Leave no MPS daemon behind, whatever happened above.
pkill -f nvidia-cuda-mps-control; pkill -f nvidia-cuda-mps-server; sleep 1
exit 0
