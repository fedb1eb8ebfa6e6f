#!/usr/bin/env bash
# On the GPU machine: the conformance programs (issue 4) and their captured steps (issue 5)
# with the workers on the GPU, the test process a client without one. Logs straight into
# $OUT, no pipes (a worker left behind cannot hold a pipe open). -rP keeps the output of passed
# capture tests too: the worker log says how each program ran (defined / captured / why not).
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
export GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0
CUDA_VISIBLE_DEVICES= timeout -k 5 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/torch/test_conformance_gpu.py -rs > "$OUT/conformance_gpu.log" 2>&1
echo "conformance rc=$?" >> "$OUT/conformance_gpu.log"
pkill -9 -f gpupool.worker
CUDA_VISIBLE_DEVICES= timeout -k 5 280 python3 -m pytest -q -rP -p no:cacheprovider tests/torch/test_capture.py > "$OUT/test_capture_gpu.log" 2>&1
echo "capture tests rc=$?" >> "$OUT/test_capture_gpu.log"
pkill -9 -f gpupool.worker
exit 0
