#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11): workers ready before the lease (issue 26).
# Three parts, one device command each (each under 5 minutes); carry .whl.
#   bash bench/gpu/run_issue26_ready.sh probe: where a ready CUDA worker's context is made
#       (bench/gpu/ready_context_probe.py): cold start, context at hand-over under MPS with the
#       share set then (30 % vs 100 % matmul TFLOP/s says whether the share holds), context
#       made ahead without MPS, and CUDA green contexts (made how fast, do 30 % of the SMs
#       run at about 30 %).
#   bash bench/gpu/run_issue26_ready.sh lease: bench/lease_start.py --gpu: grant-to-first-op
#       p50/p95 over 20 remote leases with one ready worker per GPU and 8 cold, at the
#       agent's default 2 s heartbeat; $OUT/lease_start_gpu.json.
#   bash bench/gpu/run_issue26_ready.sh fast: the same with ready workers only and a 0.25 s
#       heartbeat (what is left once the agent hears of a grant sooner);
#       $OUT/lease_start_gpu_fast_heartbeat.json.
# The compact summary is the last lines of stdout; logs are in $OUT.
set -u
part=${1:-probe}
. bench/gpu/site.sh
# Workers run as the unprivileged gpupool-worker user: it must reach the interpreter, the
# wheels and this checkout (search bit only, as scripts/setup.sh does).
for p in "$(python3 -c 'import sys; print(sys.base_prefix)')" "$(python3 -c 'import sys; print(sys.prefix)')" /tmp/site "$PWD"; do
  while [ "$p" != / ] && [ -n "$p" ]; do chmod o+x "$p" 2>/dev/null; p=$(dirname "$p"); done
done
chmod -R o+rX /tmp/site "$PWD/src" 2>/dev/null
stop_workers() { pkill -9 -f 'gpupool[.]worker'; pkill -9 -f 'nvidia-cuda-mp[s]' 2>/dev/null; sleep 1; }
{ nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available())'; } > "$OUT/setup.log" 2>&1
case "$part" in
  probe)
    timeout -k 5 270 python3 bench/gpu/ready_context_probe.py --repeat 3 > "$OUT/probe.log" 2>&1
    echo "probe rc=$?"
    stop_workers
    grep '^{' "$OUT/probe.log" | tail -1 || tail -30 "$OUT/probe.log" ;;
  lease|fast)
    if [ "$part" = lease ]; then
      name=lease_start_gpu; args=(--leases 20 --cold-leases 8 --ready-workers 1,0 --interval 2); limit=280
    else
      name=lease_start_gpu_fast_heartbeat; args=(--leases 20 --ready-workers 1 --interval 0.25); limit=200
    fi
    work=$(mktemp -d /tmp/lease-start.XXXXXX)
    timeout -k 5 $limit python3 bench/lease_start.py --gpu "${args[@]}" --memory 2GiB \
      --work "$work" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "$part rc=$?"
    stop_workers
    # The pool's and the workers' logs, one file: where a slow hand-over spent its time.
    (cd "$work" && find . -name '*.log' -size -20M | tar czf "$OUT/${name}_logs.tgz" -T -)
    python3 - "$OUT/$name.json" <<'EOF'
import json, sys, pathlib
path = pathlib.Path(sys.argv[1])
if not path.exists():
    sys.exit(f"{path.name} missing")
data = json.loads(path.read_text())
for run in data["runs"]:
    print(json.dumps({"interval_s": data["heartbeat_interval_s"],
                      **{k: v for k, v in run.items() if k != "rows"}}))
print(data["machine"])
EOF
    tail -3 "$OUT/$name.log" ;;
  *) echo "parts: probe, lease, fast" >&2; exit 2 ;;
esac
exit 0
