#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2): the staged swap and handoff copies' GPU tests, then
# ResNet-50 (bf16 autocast, SGD) migrated from GPU 0 to GPU 1 mid-run with ~5 GiB of state by
# CUDA IPC and by the shared-memory path (what workers under separate MPS daemons use), each
# swapped out when idle and restored, each compared with the same run unmigrated. Every log
# straight into $OUT (no pipes, so a worker left behind cannot hold a pipe open).
#   run: bash bench/gpu/run_issue9b.sh   (carry .whl; results in $OUT/migration.json)
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
cp bench/results/migration.json "$OUT/migration.json" 2>/dev/null || true
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rs tests/worker/test_swap_gpu.py tests/worker/test_handoff.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
timeout -k 5 220 python3 bench/migration.py --state-gib 5 --steps 30 --migrate-at 10 --batch 64 --out "$OUT/migration.json" > "$OUT/migration_ipc.log" 2>&1
echo "migration 5GiB same host rc=$?" >> "$OUT/migration_ipc.log"
pkill -9 -f "gpupool.worker --lease bench-migration"
timeout -k 5 220 python3 bench/migration.py --state-gib 5 --steps 30 --migrate-at 10 --batch 64 --paths shm --out "$OUT/migration.json" > "$OUT/migration_shm.log" 2>&1
echo "migration 5GiB shm rc=$?" >> "$OUT/migration_shm.log"
pkill -9 -f "gpupool.worker --lease bench-migration"
exit 0
