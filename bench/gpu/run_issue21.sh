#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): remote tensors on PyTorch's
# PrivateUse1 backend (issue 21). One device command; every log straight into $OUT.
#   bash bench/gpu/run_issue21.sh
# 1. env.log: whether this torch has the Python backend hooks the design needs
#    (torch._C._acc with DeviceGuard, PrivateUse1Hooks and their register functions);
# 2. fidelity_cpu_workers.log / fidelity_cuda_worker.log: tests/torch/test_tensor_fidelity.py
#    with CPU workers, then with the workers on the GPU (the test process is a client without a
#    GPU: CUDA_VISIBLE_DEVICES=);
# 3. opinfo_cuda_worker.log + opinfo_sweep.json: the whole OpInfo sweep with the worker on
#    the GPU against the client's CPU (label h200_cuda_worker);
# 4. client_cost.log: bench/remote_client_cost.py (the client's cost per op, compiled path).
# (carry .whl)
set -u
. bench/gpu/site.sh
{
  nvidia-smi
  python3 - <<'PY'
import torch
acc = vars(torch._C).get("_acc")
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
print("torch._C._acc:", acc is not None and sorted(n for n in dir(acc) if not n.startswith("__")))
PY
} > "$OUT/env.log" 2>&1
CUDA_VISIBLE_DEVICES= timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/torch/test_tensor_fidelity.py > "$OUT/fidelity_cpu_workers.log" 2>&1
echo "rc=$?" >> "$OUT/fidelity_cpu_workers.log"
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 CUDA_VISIBLE_DEVICES= timeout -k 5 300 python3 -m pytest -q \
  -p no:cacheprovider -rs tests/torch/test_tensor_fidelity.py > "$OUT/fidelity_cuda_worker.log" 2>&1
echo "rc=$?" >> "$OUT/fidelity_cuda_worker.log"
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 CUDA_VISIBLE_DEVICES= timeout -k 5 420 python3 \
  bench/opinfo_sweep.py --label h200_cuda_worker --out "$OUT/opinfo_sweep.json" \
  > "$OUT/opinfo_cuda_worker.log" 2>&1
echo "rc=$?" >> "$OUT/opinfo_cuda_worker.log"
CUDA_VISIBLE_DEVICES= timeout -k 5 240 python3 bench/remote_client_cost.py --repeat 3 \
  --label h200_privateuse1 > "$OUT/client_cost.log" 2>&1
echo "rc=$?" >> "$OUT/client_cost.log"
cp bench/results/remote_client_cost.json "$OUT/" 2>/dev/null
true
