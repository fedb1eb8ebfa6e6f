#!/usr/bin/env bash
# On the GPU machine (issue 4, the worker's compiled record loop), in two calls of under 10 min:
#   OUT=/some/dir PART=checks bash bench/gpu/run_issue4i.sh                   (carry .whl)
#     both compiled paths built there; bench/worker_loop.py --device cuda:0 (the worker's CPU a
#     record, compiled loop against Python, real kernels); the GPU conformance programs with
#     CUDA workers (the compiled loop stores outputs itself there: no storage counting);
#   OUT=/some/dir PART=overhead [REPEAT=5] [LIMIT=540] bash bench/gpu/run_issue4i.sh
#     the eager training-step rows, local and remote alternating (bench/remote_overhead.py).
set -u
OUT=${OUT:?set OUT to a directory for the results}
. bench/gpu/site.sh
FINAL=$OUT
OUT=$(mktemp -d)  # packed into $FINAL/results_$PART.tgz at the end (few files travel back)
PART=${PART:-checks}
python3 -c 'from gpupool.torch import dispatch; from gpupool.worker.executor import compiled_loop
print("client fastpath", dispatch.fastpath_active(), "worker loop", compiled_loop())' \
  > "$OUT/compiled.txt" 2>&1
cat "$OUT/compiled.txt"
if [ "$PART" = checks ]; then
  timeout -k 5 150 python3 bench/worker_loop.py --device cuda:0 --steps 100 --repeat 5 \
    --out "$OUT/worker_loop.json" > "$OUT/worker_loop.log" 2>&1
  echo "worker_loop rc=$?"; cat "$OUT/worker_loop.log" | tail -3
  export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0
  CUDA_VISIBLE_DEVICES= timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/torch/test_conformance_gpu.py -rs > "$OUT/conformance_gpu.log" 2>&1
  echo "conformance rc=$?"; tail -5 "$OUT/conformance_gpu.log"
  pkill -9 -f gpupool.worker
else
  cp bench/results/remote_overhead.json "$OUT/remote_overhead.json"
  timeout -k 5 "${LIMIT:-540}" python3 bench/remote_overhead.py --steps 20 --repeat "${REPEAT:-5}" \
    --timeout 120 --only "${ONLY:-resnet50,gpt2}" --out "$OUT/remote_overhead.json" \
    > "$OUT/ro_repeat.log" 2>&1
  echo "remote_overhead rc=$?"
  grep '^{' "$OUT/ro_repeat.log" | cut -c1-600
fi
tar czf "$FINAL/results_$PART.tgz" -C "$OUT" .
exit 0
