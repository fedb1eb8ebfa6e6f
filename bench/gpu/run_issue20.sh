#!/usr/bin/env bash
# On the GPU machine (nvidia-h200): the sealed pool (issue 20) with the CUDA build of torch.
# Two parts, one device command each; every log straight into $OUT, no pipes (a worker left
# behind cannot hold a pipe open).
#   bash bench/gpu/run_issue20.sh checks: the op table against this torch, the attack tests
#       (CPU workers under this torch), the workers' GPU tests (memory charged before
#       allocating, swap, handoff with the new secrets, sticky errors), and the watch of
#       direct slices with NVML and a real MPS daemon.
#   bash bench/gpu/run_issue20.sh final: the workers' memory and handoff GPU tests, the direct
#       watch and the remote limits together.
#   bash bench/gpu/run_issue20.sh mps: can worker-user clients join an MPS daemon (two
#       layouts, bench/gpu/mps_user_probe.sh), then the remote limits (bench/remote_isolation.py)
#       with workers as the worker user inside MPS, the workers' GPU memory tests and the
#       direct-slice watch. Logs: at most 8 files come back, so the small ones go into setup.log.
#   bash bench/gpu/run_issue20.sh limits: remote limits with the new credentials
#       (bench/remote_isolation.py: 30 %/70 % MPS shares, a 4 GiB lease that tries 6 GiB,
#       workers as the worker user), the conformance programs on CUDA workers, a short fuzz.
# (carry .whl)
set -u
part=${1:-checks}
. bench/gpu/site.sh
# Workers run as the unprivileged gpupool-worker user: it must reach the interpreter, the
# wheels and this checkout (search bit only, as scripts/setup.sh does).
for p in "$(python3 -c 'import sys; print(sys.base_prefix)')" "$(python3 -c 'import sys; print(sys.prefix)')" /tmp/site "$PWD"; do
  while [ "$p" != / ] && [ -n "$p" ]; do chmod o+x "$p" 2>/dev/null; p=$(dirname "$p"); done
done
chmod -R o+rX /tmp/site "$PWD/src" 2>/dev/null
stop_workers() { pkill -9 -f gpupool.worker; pkill -9 -f nvidia-cuda-mps 2>/dev/null; sleep 1; }
if [ "$part" = mps ]; then
  { nvidia-smi; python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())'; } > "$OUT/setup.log" 2>&1
  timeout -k 5 240 bash bench/gpu/mps_user_probe.sh > "$OUT/mps_probe.log" 2>&1
  echo "probe rc=$?" >> "$OUT/mps_probe.log"
  stop_workers
  timeout -k 5 220 python3 bench/remote_isolation.py > "$OUT/remote_isolation.log" 2>&1
  echo "remote isolation rc=$?" >> "$OUT/remote_isolation.log"
  cp bench/results/remote_isolation.json "$OUT/" 2>/dev/null
  stop_workers
  GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 timeout -k 5 150 python3 -m pytest -q \
    -p no:cacheprovider -rs tests/worker/test_memory_gpu.py tests/worker/test_handoff.py \
    tests/worker/test_geometry.py tests/worker/test_mps_reach.py > "$OUT/worker_gpu.log" 2>&1
  echo "worker gpu tests rc=$?" >> "$OUT/worker_gpu.log"
  stop_workers
  timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rs tests/agent/test_direct_watch_gpu.py \
    tests/agent/test_mps.py > "$OUT/direct_watch_gpu.log" 2>&1
  echo "direct watch gpu tests rc=$?" >> "$OUT/direct_watch_gpu.log"
  stop_workers
  for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -20 "$OUT/$f"; rm -f "$OUT/$f"; } >> "$OUT/setup.log"; done
elif [ "$part" = final ]; then  # the GPU-side checks and the remote limits, in one command
  GPUPOOL_TEST_WORKER_DEVICE=cuda:0 timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/worker/test_memory_gpu.py tests/worker/test_handoff.py > "$OUT/worker_gpu.log" 2>&1
  echo "worker gpu tests rc=$?" >> "$OUT/worker_gpu.log"
  stop_workers
  timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rs tests/agent/test_direct_watch_gpu.py \
    > "$OUT/direct_watch_gpu.log" 2>&1
  echo "direct watch gpu tests rc=$?" >> "$OUT/direct_watch_gpu.log"
  stop_workers
  timeout -k 5 220 python3 bench/remote_isolation.py > "$OUT/remote_isolation.log" 2>&1
  echo "remote isolation rc=$?" >> "$OUT/remote_isolation.log"
  cp bench/results/remote_isolation.json "$OUT/" 2>/dev/null
  stop_workers
elif [ "$part" = checks ]; then
  { nvidia-smi; python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())'; } > "$OUT/env.log" 2>&1
  python3 -m gpupool.worker.oppolicy --check > "$OUT/oppolicy_check.log" 2>&1
  echo "oppolicy --check rc=$?" >> "$OUT/oppolicy_check.log"
  timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -rs tests/worker/test_oppolicy.py \
    tests/worker/test_op_attacks.py tests/worker/test_memory_attacks.py \
    tests/worker/test_worker_credentials.py tests/worker/test_worker_fuzz.py > "$OUT/attacks_torch211.log" 2>&1
  echo "attack tests rc=$?" >> "$OUT/attacks_torch211.log"
  stop_workers
  GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 timeout -k 5 150 python3 -m pytest -q \
    -p no:cacheprovider -rs tests/worker/test_memory_gpu.py tests/worker/test_swap_gpu.py \
    tests/worker/test_handoff.py tests/worker/test_sticky_error_gpu.py > "$OUT/worker_gpu.log" 2>&1
  echo "worker gpu tests rc=$?" >> "$OUT/worker_gpu.log"
  stop_workers
  timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rs tests/agent/test_direct_watch_gpu.py \
    tests/agent/test_gpu_machine.py > "$OUT/direct_watch_gpu.log" 2>&1
  echo "direct watch gpu tests rc=$?" >> "$OUT/direct_watch_gpu.log"
  stop_workers
else
  timeout -k 5 220 python3 bench/remote_isolation.py > "$OUT/remote_isolation.log" 2>&1
  echo "remote isolation rc=$?" >> "$OUT/remote_isolation.log"
  cp bench/results/remote_isolation.json "$OUT/" 2>/dev/null
  stop_workers
  export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0
  CUDA_VISIBLE_DEVICES= timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/torch/test_conformance_gpu.py -rs > "$OUT/conformance_gpu.log" 2>&1
  echo "conformance rc=$?" >> "$OUT/conformance_gpu.log"
  stop_workers
  unset GPUPOOL_TEST_WORKER_DEVICE GPUPOOL_TEST_WORKER_GPUS
  timeout -k 5 100 python3 bench/worker_fuzz.py --minutes 1 --seed 7 --out "$OUT/worker_fuzz_torch211.json" > "$OUT/worker_fuzz_torch211.log" 2>&1
  echo "fuzz rc=$?" >> "$OUT/worker_fuzz_torch211.log"
  stop_workers
fi
exit 0
