#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build), one device command of about 7
# minutes (carry .whl): the client changes that only a CUDA worker can judge.
#   1. bench/gpu/run_batch_norm.sh: batch norm through a CUDA worker bit for bit against the
#      local GPU, and the OpInfo sweep of the normalisation ops and linear (recorded through a
#      CUDA worker, replayed against the local GPU).
#   2. bench/remote_real.py, every loop (results in bench/results/remote_real.json, copied to
#      $OUT).
#   bash bench/gpu/run_client_checks.sh
set -u
bash bench/gpu/run_batch_norm.sh
. bench/gpu/site.sh
timeout -k 5 330 python3 bench/remote_real.py --timeout 120 --label h200 2> "$OUT/remote_real.err" | tail -14
echo "remote_real rc=${PIPESTATUS[0]}"
tail -3 "$OUT/remote_real.err"
cp bench/results/remote_real.json "$OUT/" 2>/dev/null
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
