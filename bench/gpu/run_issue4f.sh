#!/usr/bin/env bash
# On the GPU machine (issue 4, the eager training-step rows with repeats), one command:
#   OUT=/some/dir bash bench/gpu/run_issue4f.sh
# ResNet-50 at batch 32 and 128 and the GPT-2 step, local and remote alternating three times
# each; each row is the run with the median ratio, `ratios` has all three. Rows are merged into
# a copy of bench/results/remote_overhead.json in $OUT (the micro-benchmark rows are kept).
set -u
OUT=${OUT:?set OUT to a directory for the results}
. bench/gpu/site.sh
cp bench/results/remote_overhead.json "$OUT/remote_overhead.json"
timeout -k 5 ${LIMIT:-450} python3 bench/remote_overhead.py --steps 20 --repeat 3 --timeout 120 \
  --only resnet50,gpt2 --out "$OUT/remote_overhead.json" > "$OUT/ro_repeat.log" 2>&1
echo "remote_overhead rc=$?" >> "$OUT/ro_repeat.log"
grep '^{' "$OUT/ro_repeat.log" | cut -c1-700
tail -2 "$OUT/ro_repeat.log"
exit 0
