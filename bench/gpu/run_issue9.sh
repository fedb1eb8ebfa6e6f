#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2): the staged swap and handoff copies' GPU tests, then
# ResNet-50 (bf16 autocast, SGD) migrated from GPU 0 to GPU 1 mid-run with ~5 GiB of state,
# swapped out when idle and restored, each run compared with the same run unmigrated: by the
# same-host path (CUDA IPC), then with the successor forced onto each other path: the chunked
# stream (a move between servers) and the memfd (workers under separate MPS daemons). On a
# one-GPU machine the move goes to a new worker on the same GPU and the rows say so. Every log
# straight into $OUT (no pipes, so a worker left behind cannot hold a pipe open).
#   run: bash bench/gpu/run_issue9.sh [PATHS...]   (default: all stream shm; carry .whl;
#        results in $OUT/migration.json)
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
cp bench/results/migration.json "$OUT/migration.json" 2>/dev/null || true
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), hasattr(torch.UntypedStorage, "_share_cuda_"), hasattr(torch.UntypedStorage, "_new_shared_cuda"))' > "$OUT/env.log" 2>&1
nvidia-smi topo -m >> "$OUT/env.log" 2>&1
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rs tests/worker/test_swap_gpu.py tests/worker/test_handoff.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
for path in "${@:-all stream shm}"; do
  for p in $path; do
    if [ "$p" = all ]; then only=(); else only=(--paths "$p"); fi
    timeout -k 5 220 python3 bench/migration.py --state-gib 5 --steps 30 --migrate-at 10 --batch 64 "${only[@]}" --out "$OUT/migration.json" > "$OUT/migration_$p.log" 2>&1
    echo "migration 5GiB $p rc=$?" >> "$OUT/migration_$p.log"
    pkill -9 -f "gpupool.worker --lease bench-migration"
  done
done
exit 0
