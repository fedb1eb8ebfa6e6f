#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): issue 21's points that need a CUDA
# worker and have no run yet, in one device command of a few minutes, a client without a GPU
# against its workers on GPU 0:
#   - the recurrent and cuDNN tests of tests/torch/test_conformance_gpu.py;
#   - captured steps and torch.compile's inference calls compiled by Inductor on the worker
#     (Triton kernels, then a CUDA graph: modes `inductor+graph`);
#   - sparse COO tensors and packed sequences on a CUDA worker;
#   - bench/remote_overhead.py --mode compiled: a captured ResNet-50 step compiled there.
#   bash bench/gpu/run_issue21_cuda_worker.sh [tests|bench|all]   (carry .whl, made by
#     `../shared/tools/device-wheels controller agent k8s programs`); `tests` (the three
#     pytest runs, under 10 minutes) and `bench` (the compiled ResNet-50 step) fit one
#     device command each.
# stdout: each pytest's summary; $OUT/*.log: their whole output.
set -u
. bench/gpu/site.sh
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0
run() {
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= timeout -k 5 "$@" > "$OUT/$name.log" 2>&1
  echo "===== $name rc=$?"; tail -4 "$OUT/$name.log"
}
part=${1:-all}
if [ "$part" != bench ]; then
run recurrent 170 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/torch/test_conformance_gpu.py -k "recurrent or cudnn"
run inductor 220 python3 -m pytest -q -p no:cacheprovider -rs tests/torch/test_capture.py \
  tests/torch/test_remote_apis.py -k "inductor or compiled or own_memory"
run sparse_packed 130 python3 -m pytest -q -p no:cacheprovider -rs tests/torch/test_sparse.py \
  tests/torch/test_real_programs.py -k "sparse or packed or recurrent"
fi
if [ "$part" != tests ]; then
# Captured ResNet-50 steps compiled by Inductor on the worker against the local eager step.
timeout -k 5 300 python3 bench/remote_overhead.py --mode compiled --only resnet50:32 \
  --out "$OUT/remote_compiled_h200.json" > "$OUT/compiled_bench.log" 2>&1
echo "===== compiled bench rc=$?"; grep '^{' "$OUT/compiled_bench.log" | cut -c1-400
fi
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
