#!/usr/bin/env bash
# On the GPU machine (nvidia-h200): the sealed pool (issue 20) with the CUDA build of torch.
# Two parts, one device command each; every log straight into $OUT, no pipes (a worker left
# behind cannot hold a pipe open).
#   bash bench/gpu/run_issue20.sh checks: the op table against this torch, the attack tests
#       (CPU workers under this torch), the workers' GPU tests (memory charged before
#       allocating, swap, handoff with the new secrets, sticky errors), and the watch of
#       direct slices with NVML and a real MPS daemon.
#   bash bench/gpu/run_issue20.sh final: the op table and attack tests under this torch, the
#       MPS layouts, the remote limits, the workers' GPU tests and the direct watch, together.
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
stop_workers() { pkill -9 -f 'gpupool[.]worker'; pkill -9 -f 'nvidia-cuda-mp[s]' 2>/dev/null; sleep 1; }
# step NAME TIMEOUT COMMAND...: the command's output in $OUT/NAME.log, its status at the end.
step() {
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.log"
  stop_workers
}
gpu_env=(env GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0)
pytest_q=(python3 -m pytest -q -p no:cacheprovider -rs)
attacks() {
  step attacks_torch211 170 "${pytest_q[@]}" tests/worker/test_oppolicy.py tests/worker/test_op_attacks.py \
    tests/worker/test_memory_attacks.py tests/worker/test_worker_credentials.py tests/worker/test_worker_fuzz.py \
    tests/worker/test_geometry.py
}
isolation() {
  step remote_isolation 220 python3 bench/remote_isolation.py
  cp bench/results/remote_isolation.json "$OUT/" 2>/dev/null
}
worker_gpu() {
  step worker_gpu 170 "${gpu_env[@]}" "${pytest_q[@]}" tests/worker/test_memory_gpu.py tests/worker/test_swap_gpu.py \
    tests/worker/test_handoff.py tests/worker/test_sticky_error_gpu.py tests/worker/test_geometry.py \
    tests/worker/test_mps_reach.py
}
direct_watch() {
  step direct_watch_gpu 150 "${pytest_q[@]}" tests/agent/test_direct_watch_gpu.py tests/agent/test_gpu_machine.py \
    tests/agent/test_mps.py
}
{ nvidia-smi; python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())'; } > "$OUT/setup.log" 2>&1
case "$part" in
  mps)
    step mps_probe 240 bash bench/gpu/mps_user_probe.sh
    isolation; worker_gpu; direct_watch ;;
  final)
    python3 -m gpupool.worker.oppolicy --check >> "$OUT/setup.log" 2>&1
    echo "oppolicy --check rc=$?" >> "$OUT/setup.log"
    attacks; isolation; worker_gpu; direct_watch ;;
  sealed)  # what changed with the fuzzer's fixes: the table under this torch, the attacks, GPU tests
    python3 -m gpupool.worker.oppolicy --check >> "$OUT/setup.log" 2>&1
    echo "oppolicy --check rc=$?" >> "$OUT/setup.log"
    attacks; worker_gpu; direct_watch
    for f in attacks_torch211 worker_gpu direct_watch_gpu; do echo "##### $f"; grep -E "passed|failed|error|rc=" "$OUT/$f.log" | tail -4; done
    grep "rc=" "$OUT/setup.log" ;;
  checks)
    python3 -m gpupool.worker.oppolicy --check >> "$OUT/setup.log" 2>&1
    echo "oppolicy --check rc=$?" >> "$OUT/setup.log"
    attacks; worker_gpu; direct_watch ;;
  limits)
    isolation
    step conformance_gpu 200 env CUDA_VISIBLE_DEVICES= "${gpu_env[@]}" "${pytest_q[@]}" -m gpu tests/torch/test_conformance_gpu.py
    step worker_fuzz_torch211 100 python3 bench/worker_fuzz.py --minutes 1 --seed 7 --out "$OUT/worker_fuzz_torch211.json" ;;
esac
# At most 8 files come back: the small logs go into setup.log.
for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -20 "$OUT/$f"; rm -f "$OUT/$f"; } >> "$OUT/setup.log"; done
exit 0
