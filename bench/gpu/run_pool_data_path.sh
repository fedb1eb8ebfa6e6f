#!/usr/bin/env bash
# On the GPU machine (torch 2.11 CUDA build), one device command of under 10 minutes:
#   - bench/put_lanes.py: loopback TCP with 1, 2, 4 and 8 connections, and a 256 MiB pinned
#     put to a CUDA worker with 0, 2 and 4 lanes;
#   - bench/remote_real.py, every loop (pinned tensors from the shared region over Unix+shm,
#     large puts over lanes over TCP): bench/results/remote_real.json, copied to $OUT;
#   - bench/gpu/profile_worker.py: where a CUDA worker's time goes while it serves GPT-2
#     decoding (py-spy, when .whl carries it: `pip download py-spy` into .whl and a `py-spy`
#     line in .whl/requirements.txt);
#   - the data-path tests on a CUDA worker (pinned region registered for DMA, lanes,
#     non-blocking copies). Inductor on a CUDA worker is in run_issue21_cuda_worker.sh.
#   bash bench/gpu/run_pool_data_path.sh   (carry .whl)
set -u
. bench/gpu/site.sh
nvidia-smi -L
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= timeout 60 python3 bench/put_lanes.py \
  --device cuda:0 --out "$OUT/put_lanes_gpu.json" | tail -1
timeout -k 5 330 python3 bench/remote_real.py --timeout 120 --label "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' _)" 2> "$OUT/remote_real.err"
echo "remote_real rc=$?"; tail -3 "$OUT/remote_real.err"
cp bench/results/remote_real.json "$OUT/" 2>/dev/null
pkill -9 -f 'gpupool[.]worker'
PATH=/tmp/site/bin:$PATH timeout -k 5 60 python3 bench/gpu/profile_worker.py --loop gpt2_generate \
  --seconds 12 --out "$OUT/profile_worker_generate.json" > "$OUT/profile_worker.log" 2>&1
echo "profile_worker rc=$?"; head -c 6000 "$OUT/profile_worker.log"
pkill -9 -f 'gpupool[.]worker'
export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0
run() {
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= timeout -k 5 "$@" > "$OUT/$name.log" 2>&1
  echo "===== $name rc=$?"; tail -3 "$OUT/$name.log"
  pkill -9 -f 'gpupool[.]worker'
}
run paths 60 python3 -m pytest -q -p no:cacheprovider tests/torch/test_remote_apis.py \
  tests/torch/test_remote_loops.py -k "own_memory or lanes or non_blocking"
exit 0
