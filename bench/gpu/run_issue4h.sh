#!/usr/bin/env bash
# On the GPU machine (issue 4, the compiled client hot path), one command:
#   OUT=/some/dir [REPEAT=3] [LIMIT=380] [CLIENT="resnet gpt2"] [FLOOR=1] [RO_ARGS=--pin] [ONLY=resnet50:32,gpt2] \
#     bash bench/gpu/run_issue4h.sh                                           (carry .whl)
# 1. whether gpupool.torch._fastpath built there (site.sh builds it for that Python);
# 2. bench/remote_client_cost.py --ab: the client's issue CPU per step with the compiled path
#    and the Python one, steps alternating in one process (tiny models, a CPU worker);
# 3. the eager training-step rows, local and remote alternating three times each
#    (bench/remote_overhead.py --repeat 3), merged into a copy of remote_overhead.json;
# 4. bench/dispatch_floor.py with a CUDA worker (per-op floor, compiled and Python paths).
set -u
OUT=${OUT:?set OUT to a directory for the results}
. bench/gpu/site.sh
FINAL=$OUT
OUT=$(mktemp -d)  # everything is packed into $FINAL/results.tgz at the end (few files travel back)
python3 -c 'from gpupool.torch import dispatch; print("fastpath", dispatch.fastpath_active())' \
  > "$OUT/fastpath.txt" 2>&1
cat "$OUT/fastpath.txt"
for w in ${CLIENT-resnet gpt2}; do
  timeout -k 5 90 python3 bench/remote_client_cost.py --workload "$w" --steps 30 --repeat 1 --ab \
    > "$OUT/client_cost_$w.json" 2> "$OUT/client_cost_$w.err"
  echo "client_cost $w rc=$?"
  grep -E '"(fastpath|issue_cpu_ms|python_issue_cpu_ms|worker_busy_ms|ops_per_step)"' \
    "$OUT/client_cost_$w.json" | head -5 | tr -d '\n '
  echo
done
cp bench/results/remote_overhead.json "$OUT/remote_overhead.json"
timeout -k 5 "${LIMIT:-380}" python3 bench/remote_overhead.py --steps 20 --repeat "${REPEAT:-3}" --timeout 120 \
  --only ${ONLY:-resnet50,gpt2} ${RO_ARGS:-} --out "$OUT/remote_overhead.json" > "$OUT/ro_repeat.log" 2>&1
echo "remote_overhead rc=$?"
grep '^{' "$OUT/ro_repeat.log" | cut -c1-600
if [ "${FLOOR:-1}" = 1 ]; then
  cp bench/results/dispatch_floor.json "$OUT/dispatch_floor.json"
  timeout -k 5 60 python3 bench/dispatch_floor.py --device cuda:0 --out "$OUT/dispatch_floor.json" \
    > "$OUT/dispatch_floor.log" 2>&1
  echo "dispatch_floor rc=$?"
  grep '^{' "$OUT/dispatch_floor.log" | cut -c1-400
fi
tar czf "$FINAL/results.tgz" -C "$OUT" .
exit 0
