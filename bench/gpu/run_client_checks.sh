#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build), one device command of about 8
# minutes (carry .whl): the client changes that only a CUDA worker can judge.
#   1. The OpInfo sweep (bench/opinfo_sweep.py, record through a CUDA worker, replay against
#      the local GPU) of the batch-norm and linear ops: batch norm on batch statistics alone
#      now reaches the worker as _batch_norm_with_update, so the worker picks cuDNN as a local
#      GPU does (its backward differed before); linear without a gradient goes whole.
#   2. bench/remote_real.py, every loop (results in bench/results/remote_real.json, copied to
#      $OUT).
#   bash bench/gpu/run_client_checks.sh
set -u
. bench/gpu/site.sh
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
work=$(mktemp -d)
ops=nn.functional.batch_norm,nn.functional.instance_norm,native_batch_norm,_native_batch_norm_legit,nn.functional.linear,nn.functional.bilinear,nn.functional.group_norm
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= \
  timeout -k 5 150 python3 bench/opinfo_sweep.py --ops "$ops" --record "$work/ops.pt" \
  > "$OUT/sweep_ops.log" 2>&1
echo "record rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout -k 5 100 python3 bench/opinfo_sweep.py --replay "$work/ops.pt" \
  --device cuda --label h200_batch_norm_linear --out "$OUT/sweep_ops.json" >> "$OUT/sweep_ops.log" 2>&1
echo "replay rc=$?"
python3 - "$OUT/sweep_ops.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except OSError as exc:
    sys.exit(f"no sweep result: {exc}")
for label, run in data.items():
    for name, part in run.items():
        if isinstance(part, dict) and "samples" in part:
            print(label, name, {k: part[k] for k in ("tried", "passed", "mismatches", "errors")},
                  [f.get("op") if isinstance(f, dict) else f for f in part.get("failures", [])])
PY
pkill -9 -f 'gpupool[.]worker' 2>/dev/null; sleep 1
timeout -k 5 330 python3 bench/remote_real.py --timeout 120 --label h200 2> "$OUT/remote_real.err" | tail -14
echo "remote_real rc=$?"
tail -3 "$OUT/remote_real.err"
cp bench/results/remote_real.json "$OUT/" 2>/dev/null
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
