#!/usr/bin/env bash
# On the GPU machine (issue 4, eager rows after the hot-path work), one command:
#   OUT=/some/dir bash bench/gpu/run_issue4d.sh
# ResNet-50 at batch 32 and 128, the GPT-2 step, op throughput, round trip, copy bandwidth and
# the memory-isolation row, local and through a worker in one run. Rows are merged into a copy of
# bench/results/remote_overhead.json in $OUT (rows of other modes, e.g. captured, are kept; eager
# rows of the same workload are replaced). Remote rows carry the client's issue time and the
# worker's own time per step (remote_issue_ms, remote_worker_busy_ms): the larger of the two
# and the GPU's time bounds the step. Logs go straight into $OUT (no pipes, so a worker left
# behind cannot hold a pipe open).
set -u
OUT=${OUT:?set OUT to a directory for the results}
. bench/gpu/site.sh
cp bench/results/remote_overhead.json "$OUT/remote_overhead.json"
timeout -k 5 480 python3 bench/remote_overhead.py --steps 15 --timeout 120 \
  --only resnet50,gpt2,op_throughput,round_trip,copy,isolation \
  --out "$OUT/remote_overhead.json" > "$OUT/ro_eager.log" 2>&1
echo "remote_overhead rc=$?" >> "$OUT/ro_eager.log"
grep '^{' "$OUT/ro_eager.log" | cut -c1-600
exit 0
