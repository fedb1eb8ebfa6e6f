#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), one command:
#   OUT=/some/dir bash bench/gpu/run_issue4g.sh      (carry .whl)
# The GPU tests of what was so far tested with CPU workers only, the test process a client
# without a GPU (CUDA_VISIBLE_DEVICES=), its workers on the GPUs:
#   tests/torch/test_peer_copy_gpu.py    copies worker to worker between two CUDA workers (one
#                                        GPU each: GPUPOOL_TEST_PEER_GPUS), TCP and Unix sockets
#   tests/worker/test_sticky_error_gpu.py  a device-side assert: the client's error, the
#                                        worker's exit status 3, the agent's report
#   tests/torch/test_conformance_gpu.py  the conformance programs on CUDA workers
# Everything goes to $OUT/issue4g.log (no pipes: a worker left behind cannot hold a pipe
# open); its tail is printed. `timeout` signals its whole process group, so the workers a
# timed-out pytest started end with it.
set -u
OUT=${OUT:?set OUT to a directory for the results}
. bench/gpu/site.sh
# Two GPUs: one worker on each; one GPU: both workers on it (two processes, two contexts).
peers=0,1
[ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -lt 2 ] && peers=0,0
export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 GPUPOOL_TEST_PEER_GPUS=${GPUPOOL_TEST_PEER_GPUS:-$peers}
LOG="$OUT/issue4g.log"
{
  echo "== environment"
  python3 -c 'import sys, torch
print(sys.version.split()[0], "torch", torch.__version__, "GPUs", torch.cuda.device_count())'
  nvidia-smi -L
} > "$LOG" 2>&1

run_tests() {  # run_tests NAME LIMIT_S FILE...
  local name=$1 limit=$2
  shift 2
  echo "== $name" >> "$LOG"
  CUDA_VISIBLE_DEVICES= timeout -k 5 "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    "$@" >> "$LOG" 2>&1
  echo "$name rc=$?" >> "$LOG"
  if pgrep -af 'gpupool[.]worker --lease lease-(peer-gpu|sticky|gpu) ' >> "$LOG" 2>&1; then
    echo "(test workers left behind, above)" >> "$LOG"
  fi
}

run_tests peer_copy "${LIMIT_PEER:-180}" tests/torch/test_peer_copy_gpu.py
run_tests sticky_error "${LIMIT_STICKY:-120}" tests/worker/test_sticky_error_gpu.py
run_tests conformance "${LIMIT_CONFORMANCE:-220}" tests/torch/test_conformance_gpu.py
grep -E '^(== |[a-z_]+ rc=)|passed|failed|skipped|error' "$LOG" | cut -c1-300 | head -n 60
echo "-- tail of $LOG"
tail -n 40 "$LOG"
exit 0
