#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): the APIs programs use around remote
# tensors (issue 21), against a worker on the GPU. The test process is a client without a GPU
# (CUDA_VISIBLE_DEVICES empty), as a pool client is; its workers get GPU 0.
#   bash bench/gpu/run_issue21_apis.sh
# Shows, in $OUT/remote_apis_gpu.log: pinned loaders over forked and spawned workers,
# torch.accelerator, real CUDA streams and events on the worker (elapsed_time measured there),
# the deterministic switches applied on the GPU (two seeded CNN runs bit-identical),
# allocation failures at the call, GradScaler, torch.compile, DLPack errors; and in
# test_a_remote_program_prints_nothing_on_stderr, that the CUDA build's kernel-override
# UserWarning is no longer printed. $OUT/remote_apis_cpu_workers.log: the same tests with CPU
# workers under torch 2.11. (carry .whl)
set -u
. bench/gpu/site.sh
python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())' > "$OUT/env.log" 2>&1
CUDA_VISIBLE_DEVICES= GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 \
  timeout -k 5 280 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/torch/test_remote_apis.py > "$OUT/remote_apis_gpu.log" 2>&1
echo "remote APIs, GPU worker rc=$?" >> "$OUT/remote_apis_gpu.log"
CUDA_VISIBLE_DEVICES= timeout -k 5 280 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/torch/test_remote_apis.py tests/worker/test_flags_and_streams.py \
  > "$OUT/remote_apis_cpu_workers.log" 2>&1
echo "remote APIs, CPU workers rc=$?" >> "$OUT/remote_apis_cpu_workers.log"
