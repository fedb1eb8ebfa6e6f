#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11): the remote-fidelity checks in one device command.
#   bash bench/gpu/run_final.sh   (carry .whl)
# setup.log: whether this torch has the Python backend hooks remote tensors need (torch._C._acc);
# remote_isolation.log/json: two remote leases through the client on this torch (30 %/70 %,
# a 4 GiB lease refused 6 GiB); fidelity_cuda_worker.log: tests/torch/test_tensor_fidelity.py
# with the worker on the GPU and a client without one; remote_apis_gpu.log: the remote API tests
# against a GPU worker (streams, events, deterministic switches, torch.accelerator, DataLoader,
# a quiet stderr); k8s_device_nodes.log/json: what the device plugin's Allocate would name here.
set -u
. bench/gpu/site.sh
{
  nvidia-smi -L
  python3 -c 'import torch; a = vars(torch._C).get("_acc"); print("torch", torch.__version__, torch.cuda.is_available(), "_acc:", a is not None and sorted(n for n in dir(a) if not n.startswith("__")))'
} > "$OUT/setup.log" 2>&1
stop_workers() { pkill -9 -f 'gpupool[.]worker'; pkill -9 -f 'nvidia-cuda-mp[s]' 2>/dev/null; sleep 1; }
step() {  # NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.log"
  stop_workers
}
step remote_isolation 150 python3 bench/remote_isolation.py
cp bench/results/remote_isolation.json "$OUT/" 2>/dev/null
step fidelity_cuda_worker 150 env GPUPOOL_TEST_WORKER_DEVICE=cuda:0 CUDA_VISIBLE_DEVICES= \
  python3 -m pytest -q -p no:cacheprovider -rs -x tests/torch/test_tensor_fidelity.py
step remote_apis_gpu 200 env GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= \
  python3 -m pytest -q -p no:cacheprovider -rs tests/torch/test_remote_apis.py
step k8s_device_nodes 60 python3 bench/gpu/k8s_device_nodes.py
cp bench/results/k8s_device_nodes.json "$OUT/" 2>/dev/null
for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -20 "$OUT/$f"; rm -f "$OUT/$f"; } >> "$OUT/setup.log"; done
exit 0
