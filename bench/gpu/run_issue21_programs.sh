#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): the real-program set of issue 21
# (tests/torch/real_programs.py: GPT-2, BERT, T5, ViT, Llama from transformers configs,
# torchvision's ResNet-18, MobileNetV3 and ViT, PyTorch's MNIST, word language model and DCGAN)
# on the local GPU and through a worker on the same GPU, compared number by number. Within 7
# minutes; a step that fails says why and the others go on.
#   bash bench/gpu/run_issue21_programs.sh   (carry .whl; transformers and torchvision are on
#                                              the machine's image)
# 1. local: bench/real_programs.py run --device cuda, deterministic algorithms on (warn-only:
#    a GPU lacks deterministic kernels for a few of their ops), cuDNN benchmark off,
#    CUBLAS_WORKSPACE_CONFIG=:4096:8;
# 2. remote: the same with this process seeing no GPU and a worker on GPU 0 (the switches go
#    to the worker; the worker sets the cuBLAS workspace itself);
# 3. compare: EQUAL per program where bit-identical (expected: same GPU, same kernels), else
#    the largest relative difference and where;
# 4. tests/torch/test_real_programs.py with CPU workers under torch 2.11 (local CPU against a
#    CPU worker, as in CI).
# stdout: the comparison and the tests' summary; $OUT: both JSON reports and the logs.
set -u
. bench/gpu/site.sh
export CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -c 'import torch, transformers, torchvision; print("torch", torch.__version__, torch.cuda.get_device_name(0), "transformers", transformers.__version__, "torchvision", torchvision.__version__)' 2>&1 | tail -1
step() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc"
  grep -v -i warn "$OUT/$name.log" | tail -14
  pkill -9 -f 'gpupool[.]worker' 2>/dev/null
  return 0
}
step programs_local 110 env CUDA_VISIBLE_DEVICES=0 \
  python3 bench/real_programs.py run --device cuda --out "$OUT/programs_local.json"
step programs_remote 170 env CUDA_VISIBLE_DEVICES= GPUPOOL_TEST_WORKER_GPUS=0 \
  python3 bench/real_programs.py run --remote cuda:0 --out "$OUT/programs_remote.json"
if [ -f "$OUT/programs_local.json" ] && [ -f "$OUT/programs_remote.json" ]; then
  echo "== local CUDA vs remote CUDA (same H200)"
  python3 bench/real_programs.py compare "$OUT/programs_local.json" "$OUT/programs_remote.json"
else
  echo "== no comparison: a run wrote no report (see above)"
fi
step real_program_tests_cpu_workers 110 env CUDA_VISIBLE_DEVICES= \
  python3 -m pytest -q -p no:cacheprovider -rs tests/torch/test_real_programs.py
exit 0
