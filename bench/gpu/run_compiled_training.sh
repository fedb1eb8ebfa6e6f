#!/usr/bin/env bash
# On the GPU machine (torch 2.11 CUDA build): a compiled module's training calls with a CUDA
# worker (gpupool.torch.joint), a client without a GPU against its worker on GPU 0:
#   bash bench/gpu/run_compiled_training.sh tests   # the compiled tests of test_remote_apis.py
#   bash bench/gpu/run_compiled_training.sh bench [WORKLOADS]   # --mode torch-compile rows
#   bash bench/gpu/run_compiled_training.sh bench-amp [WORKLOADS]   # the same under bf16 autocast
#   bash bench/gpu/run_compiled_training.sh both [WORKLOADS]   # tests, then bench-amp (one command)
# (carry .whl, made by `../shared/tools/device-wheels controller agent k8s programs`).
# WORKLOADS defaults to resnet50:32; gpt2:8 is the other. stdout: summaries; $OUT: logs, json.
set -u
. bench/gpu/site.sh
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
part=${1:-tests}
bench_s=540
if [ "$part" = tests ] || [ "$part" = both ]; then
  GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= \
    timeout -k 5 "$([ "$part" = both ] && echo 190 || echo 300)" python3 -m pytest -q \
    -p no:cacheprovider -rs -p no:logging tests/torch/test_remote_apis.py \
    -k "compiled or max_pooling" > "$OUT/compiled_tests.log" 2>&1
  echo "===== compiled tests rc=$?"; tail -15 "$OUT/compiled_tests.log"
  bench_s=300
fi
if [ "$part" != tests ]; then
  only=${2:-resnet50:32}
  amp=; [ "$part" != bench ] && amp=--amp
  timeout -k 5 "$bench_s" python3 bench/remote_overhead.py --mode torch-compile $amp --only "$only" \
    --steps 20 --timeout $((bench_s - 20)) --out "$OUT/remote_torch_compile$amp.json" > "$OUT/bench.log" 2>&1
  echo "===== torch-compile bench rc=$?"; grep '^{' "$OUT/bench.log" | cut -c1-1500
  tail -5 "$OUT/bench.log"
fi
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
