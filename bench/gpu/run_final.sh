#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11): the second of the two last device commands, the
# remote-fidelity checks: the remote API tests against a GPU worker (streams, events, the
# deterministic switches on the GPU, torch.accelerator and DataLoader under torch 2.11, a quiet
# stderr), and what Allocate of the device plugin would name on this server. The first one is
# `bash bench/gpu/run_issue20.sh final`. (carry .whl)
set -u
. bench/gpu/site.sh
{ nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())'; } > "$OUT/setup.log" 2>&1
CUDA_VISIBLE_DEVICES= GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 \
  timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/torch/test_remote_apis.py > "$OUT/remote_apis_gpu.log" 2>&1
echo "remote APIs, GPU worker rc=$?" >> "$OUT/remote_apis_gpu.log"
pkill -9 -f 'gpupool[.]worker'
timeout -k 5 60 python3 bench/gpu/k8s_device_nodes.py > "$OUT/k8s_device_nodes.log" 2>&1
echo "k8s device nodes rc=$?" >> "$OUT/k8s_device_nodes.log"
cp bench/results/k8s_device_nodes.json "$OUT/" 2>/dev/null
for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -20 "$OUT/$f"; rm -f "$OUT/$f"; } >> "$OUT/setup.log"; done
exit 0
