#!/usr/bin/env bash
# On the GPU machine, after a session's merges: the GPU tests of the worker (staged swap and
# handoff copies), the conformance programs and captured steps with CUDA workers (the test
# process a client without a GPU), and attention by the math kernel on a CUDA worker. Logs
# straight into $OUT, no pipes (a worker left behind cannot hold a pipe open).
#   run: bash bench/gpu/run_final_checks.sh   (carry .whl)
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
timeout -k 5 100 python3 -m pytest -q -p no:cacheprovider -rs tests/worker/test_swap_gpu.py tests/worker/test_handoff.py > "$OUT/worker_gpu.log" 2>&1
echo "worker gpu tests rc=$?" >> "$OUT/worker_gpu.log"
export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0
CUDA_VISIBLE_DEVICES= timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/torch/test_conformance_gpu.py -rs > "$OUT/conformance_gpu.log" 2>&1
echo "conformance rc=$?" >> "$OUT/conformance_gpu.log"
pkill -9 -f gpupool.worker
CUDA_VISIBLE_DEVICES= timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/torch/test_capture.py "tests/torch/test_remote_tensors.py::test_attention_by_the_math_kernel_equals_local_and_trains_with_dropout" > "$OUT/capture_gpu.log" 2>&1
echo "capture and math tests rc=$?" >> "$OUT/capture_gpu.log"
pkill -9 -f gpupool.worker
exit 0
