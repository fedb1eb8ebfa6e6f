#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build), about 2 minutes (carry .whl): batch
# norm through a CUDA worker against the local GPU, bit for bit (bench/gpu/batch_norm_check.py:
# batch statistics alone, running statistics, evaluation; cuDNN on and off; float32 and
# bfloat16), then the OpInfo sweep of the normalisation ops, recorded through a CUDA worker and
# judged against the local GPU.
#   bash bench/gpu/run_batch_norm.sh
set -u
. bench/gpu/site.sh
nvidia-smi -L
timeout -k 5 300 python3 bench/gpu/batch_norm_check.py both "$(mktemp -d)" 2>&1 | cut -c1-400 | tail -40
echo "batch_norm_check rc=${PIPESTATUS[0]}"
work=$(mktemp -d)
ops=nn.functional.batch_norm,nn.functional.instance_norm,native_batch_norm,_native_batch_norm_legit,nn.functional.group_norm,nn.functional.linear
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= \
  timeout -k 5 150 python3 bench/opinfo_sweep.py --ops "$ops" --record "$work/ops.pt" \
  > "$OUT/sweep_ops.log" 2>&1
echo "record rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout -k 5 100 python3 bench/opinfo_sweep.py --replay "$work/ops.pt" \
  --device cuda --label h200_normalisation --out "$OUT/sweep_ops.json" >> "$OUT/sweep_ops.log" 2>&1
echo "replay rc=$?"
grep -E "samples pass|MISMATCH|ERROR" "$OUT/sweep_ops.log" | cut -c1-300
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
