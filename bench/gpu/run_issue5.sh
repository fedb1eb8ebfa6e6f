#!/usr/bin/env bash
# On the GPU machine: captured steps (issue 5). Two parts, one device command each (each
# fits the 10-minute limit); every log straight into $OUT, no pipes (a worker left behind
# cannot hold a pipe open).
#   bench/gpu/run_issue5.sh bench: remote_overhead --mode captured, ResNet-50 at batch 32 and
#       128 and the GPT-2-small-shaped step, captured remote (CUDA graph replay) against the
#       LOCAL EAGER step of the same run; then ResNet-50 replayed op by op (--no-graph).
#   bench/gpu/run_issue5.sh tests: the captured-step tests with their workers on the GPU
#       (CUDA graph replays against eager and local runs; the client process sees no GPU).
set -u
part=${1:-bench}
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ "$part" = bench ]; then
  timeout -k 5 380 python3 bench/remote_overhead.py --mode captured --steps 20 --timeout 170 --only resnet50,gpt2 --out "$OUT/remote_overhead_captured.json" > "$OUT/captured.log" 2>&1
  echo "captured rc=$?" >> "$OUT/captured.log"
  pkill -9 -f gpupool.worker
  timeout -k 5 150 python3 bench/remote_overhead.py --mode captured --no-graph --steps 10 --timeout 120 --only resnet50 --out "$OUT/remote_overhead_captured_ops.json" > "$OUT/captured_ops.log" 2>&1
  echo "captured op by op rc=$?" >> "$OUT/captured_ops.log"
  pkill -9 -f gpupool.worker
else
  CUDA_VISIBLE_DEVICES= GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 timeout -k 5 500 python3 -m pytest -q -p no:cacheprovider tests/torch/test_capture.py > "$OUT/test_capture_gpu.log" 2>&1
  echo "tests rc=$?" >> "$OUT/test_capture_gpu.log"
  pkill -9 -f gpupool.worker
fi
exit 0
