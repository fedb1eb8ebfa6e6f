#!/usr/bin/env bash
# On the GPU machine (issue 4, after the flusher change), one command:
#   OUT=/some/dir bash bench/gpu/run_issue4e.sh
# 1. the eager rows of bench/remote_overhead.py (bench/gpu/run_issue4d.sh);
# 2. bench/dispatch_floor.py against a CUDA worker (what Python costs per op at best);
# 3. bench/gpu/eager_probe.py base and py-spy profiles of the remote steps.
set -u
OUT=${OUT:?set OUT to a directory for the results}
START=$(date +%s)
bash bench/gpu/run_issue4d.sh
echo "4d took $(( $(date +%s) - START )) s"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
timeout -k 5 90 python3 bench/dispatch_floor.py --device cuda:0 --out "$OUT/dispatch_floor.json" > "$OUT/floor.log" 2>&1
cat "$OUT/floor.log" | cut -c1-300
echo "floor done at $(( $(date +%s) - START )) s"
LEFT=$(( 540 - ($(date +%s) - START) ))
if [ $LEFT -gt 60 ]; then
  OUT=$OUT VARIANTS=${VARIANTS:-spy} WORKLOADS=resnet50:32,gpt2:8 STEPS=15 LIMIT=$LEFT bash bench/gpu/run_probe.sh
fi
exit 0
