#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2): ResNet-50 (bf16 autocast, SGD) migrated from GPU 0 to
# GPU 1 mid-run with ~5 GiB of state, then swapped out when idle and restored; each run is
# compared with the same run unmigrated. First by the same-host path (CUDA IPC), then with the
# successor forced onto the chunked stream (what a move between servers uses). On a one-GPU
# machine the move goes to a new worker on the same GPU and the rows say so. Every log straight
# into $OUT (no pipes, so a worker left behind cannot hold a pipe open).
#   run: bash bench/gpu/run_issue9.sh   (carry .whl; results in $OUT/migration.json)
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
cp bench/results/migration.json "$OUT/migration.json" 2>/dev/null || true
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), hasattr(torch.UntypedStorage, "_share_cuda_"), hasattr(torch.UntypedStorage, "_new_shared_cuda"))' > "$OUT/env.log" 2>&1
nvidia-smi topo -m >> "$OUT/env.log" 2>&1
timeout -k 5 280 python3 bench/migration.py --state-gib 5 --steps 30 --migrate-at 10 --batch 64 --out "$OUT/migration.json" > "$OUT/migration_ipc.log" 2>&1
echo "migration 5GiB same host rc=$?" >> "$OUT/migration_ipc.log"
pkill -9 -f "gpupool.worker --lease bench-migration"
timeout -k 5 260 python3 bench/migration.py --state-gib 5 --steps 30 --migrate-at 10 --batch 64 --paths stream --out "$OUT/migration.json" > "$OUT/migration_stream.log" 2>&1
echo "migration 5GiB stream rc=$?" >> "$OUT/migration_stream.log"
pkill -9 -f "gpupool.worker --lease bench-migration"
exit 0
