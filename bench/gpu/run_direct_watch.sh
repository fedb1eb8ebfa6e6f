#!/usr/bin/env bash
# On the GPU machine (nvidia-h200): the watch of direct slices with the NVML backend and a real
# MPS daemon (issue 20): a direct program that raises its own MPS limits and allocates past its
# lease with torch is stopped within 2 s. Logs straight into $OUT.
#   run: bash bench/gpu/run_direct_watch.sh   (carry .whl)
set -u
. bench/gpu/site.sh
nvidia-smi > "$OUT/env.log" 2>&1
python3 -c 'import torch, pynvml; print(torch.__version__, torch.cuda.is_available())' >> "$OUT/env.log" 2>&1
timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider -rs tests/agent/test_direct_watch_gpu.py \
  tests/agent/test_gpu_machine.py > "$OUT/direct_watch_gpu.log" 2>&1
echo "gpu tests rc=$?" >> "$OUT/direct_watch_gpu.log"
exit 0
