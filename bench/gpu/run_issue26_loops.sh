#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): issue 26's realistic loops, local
# against a worker on the same GPU over its Unix socket with shared memory and over TCP (the
# client in a network namespace of its own, joined to the worker's by a veth pair, where root
# allows; loopback otherwise), with the link's own bandwidth and round trip measured in the
# same run. One device command, at most about 8 minutes:
#   bash bench/gpu/run_issue26_loops.sh        (carry .whl)
# stdout: one line per loop as it finishes, then the README table of
# bench/results/remote_real.json (copied to $OUT with the logs), then the CUDA-worker tests
# of the data path (non-blocking copies, chunked TCP puts through the page-locked staging
# buffers, .item() round trips, the shape rules).
set -u
. bench/gpu/site.sh
nvidia-smi -L
python3 -c 'import torch, importlib.util as u; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "torchvision", bool(u.find_spec("torchvision")), "transformers", bool(u.find_spec("transformers")))'
stop_workers() { pkill -9 -f 'gpupool[.]worker'; sleep 1; }
timeout -k 5 390 python3 bench/remote_real.py --timeout 150 --label h200 2> "$OUT/remote_real.err"
echo "remote_real rc=$?"
tail -5 "$OUT/remote_real.err"
cp bench/results/remote_real.json "$OUT/" 2>/dev/null
stop_workers
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= timeout -k 5 70 \
  python3 -m pytest -q -p no:cacheprovider -rs -x tests/torch/test_remote_loops.py \
  tests/torch/test_shape_rules.py -k "not tiny_benchmark" > "$OUT/loops_gpu_tests.log" 2>&1
echo "loops_gpu_tests rc=$?"; tail -5 "$OUT/loops_gpu_tests.log"
stop_workers
for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -5 "$OUT/$f"; }; done
exit 0
