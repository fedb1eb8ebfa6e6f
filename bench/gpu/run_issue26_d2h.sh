#!/usr/bin/env bash
# On the GPU machine (nvidia-h200): device-to-host reads through a CUDA worker, over TCP on
# loopback (chunks staged through the page-locked buffers, the next chunk's copy overlapping
# the send) and over the Unix socket (chunks announced through the registered shared arena),
# against the link's own speed; then the read tests against a CUDA worker. About 3 minutes:
#   bash bench/gpu/run_issue26_d2h.sh        (carry .whl)
# stdout: the JSON of bench/d2h_bandwidth.py (copied to $OUT), then the tests' tail.
set -u
. bench/gpu/site.sh
nvidia-smi -L
export GPUPOOL_STAGED_READS=1  # the staged CUDA reads this measures (off by default)
stop_workers() { pkill -9 -f 'gpupool[.]worker'; sleep 1; }
timeout -k 5 200 python3 bench/d2h_bandwidth.py --worker-device cuda:0 --label h200 \
  --out "$OUT/d2h_bandwidth_h200.json" 2> "$OUT/d2h.err"
echo "d2h rc=$?"; tail -5 "$OUT/d2h.err"
stop_workers
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= timeout -k 5 150 \
  python3 -m pytest -q -p no:cacheprovider -rs -x tests/torch/test_remote_reads.py \
  tests/torch/test_remote_loops.py -k "not tiny_benchmark" > "$OUT/reads_gpu_tests.log" 2>&1
echo "reads_gpu_tests rc=$?"; tail -5 "$OUT/reads_gpu_tests.log"
stop_workers
for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -5 "$OUT/$f"; }; done
exit 0
