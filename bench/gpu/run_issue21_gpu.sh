#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): issue 21's GPU points in one device
# command, at most about 9 minutes: the whole OpInfo sweep with CUDA workers judged against the
# local GPU, its PARTS parts
# (default 4) run side by side (each a client without a GPU and its own worker on GPU 0, so
# the 16 cores and one GPU hold them), and beside them the real-program set on the local GPU
# and through a worker on the same GPU, compared number by number.
#   bash bench/gpu/run_issue21_gpu.sh [PARTS]   (carry .whl, made by
#     `../shared/tools/device-wheels controller agent k8s programs`)
# stdout: the sweep merged over its parts (bench/opinfo_sweep_merge.py; each part's log in
# $OUT/sweep.log), then the programs' comparison (as bench/gpu/run_issue21_programs.sh, without
# its CPU-worker tests, which CI runs);
# $OUT: opinfo_sweep_h200.json (the merged report), sweep.log, both programs' reports.
set -u
PARTS=${1:-4}
export DEADLINE_S=${DEADLINE_S:-330}
. bench/gpu/site.sh
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
mkdir -p "$OUT/programs"
work=$(mktemp -d)
pids=()
for part in $(seq 1 "$PARTS"); do
  # Recorded by a client without a GPU through its own worker on GPU 0, then judged in a
  # process that has the GPU (bench/opinfo_sweep.py --record / --replay).
  ( GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= \
      timeout -k 5 $((DEADLINE_S + 90)) python3 bench/opinfo_sweep.py --shard "$part/$PARTS" \
      --deadline-s "$DEADLINE_S" --record "$work/part$part.pt" > "$work/part$part.log" 2>&1
    echo "record rc=$?" >> "$work/part$part.log"
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 200 python3 bench/opinfo_sweep.py \
      --replay "$work/part$part.pt" --device cuda --label "part$part" \
      --out "$work/part$part.json" >> "$work/part$part.log" 2>&1
    echo "replay rc=$?" >> "$work/part$part.log" ) &
  pids+=($!)
done
export CUBLAS_WORKSPACE_CONFIG=:4096:8
( cd "$PWD" && export OUT="$OUT/programs"
  timeout -k 5 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/real_programs.py run --device cuda \
    --out "$OUT/programs_local.json" > "$work/programs_local.log" 2>&1
  echo "programs_local rc=$?"
  timeout -k 5 300 env CUDA_VISIBLE_DEVICES= GPUPOOL_TEST_WORKER_GPUS=0 \
    python3 bench/real_programs.py run --remote cuda:0 --out "$OUT/programs_remote.json" \
    > "$work/programs_remote.log" 2>&1
  echo "programs_remote rc=$?"
  if [ -f "$OUT/programs_local.json" ] && [ -f "$OUT/programs_remote.json" ]; then
    python3 bench/real_programs.py compare "$OUT/programs_local.json" "$OUT/programs_remote.json"
  else
    grep -v -i warn "$work/programs_remote.log" | tail -8
  fi ) > "$work/programs.txt" 2>&1 &
programs=$!
wait "${pids[@]}"
for part in $(seq 1 "$PARTS"); do
  echo "===== part $part of $PARTS"; grep -v -i -E '^written to|warn' "$work/part$part.log"
done > "$OUT/sweep.log"
python3 bench/opinfo_sweep_merge.py --label h200_cuda_worker_vs_local_gpu \
  --out "$OUT/opinfo_sweep_h200.json" "$work"/part*.json
wait "$programs"
echo "===== programs: local CUDA against a CUDA worker (same H200)"
cat "$work/programs.txt"
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
