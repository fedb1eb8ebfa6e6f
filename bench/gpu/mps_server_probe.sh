#!/usr/bin/env bash
# On the GPU machine, as root: why does a ready worker's hand-over under MPS take 4-6 s in about
# half of the leases and 0.2 s in the rest (bench/lease_start.py --gpu)? A ready worker makes its
# CUDA context at the hand-over (its MPS share must be in its environment first). The question:
# does the MPS server of the worker user exit once its last client has gone, so that the next
# client waits for a new server, and does one client kept connected (a "keeper") make every
# context quick? The daemon runs as the worker user on a private pipe directory, as the agent
# runs it (gpupool.agent.mps); it is quit before the script ends.
#   bash bench/gpu/mps_server_probe.sh   (no wheels needed: torch only)
# stdout: one line per client (context seconds, whether a server ran just before and after),
# then the daemon's control and server logs.
set -u
U=gpupool-worker
id "$U" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$U"
G=$(id -g "$U")
PY=$(command -v python3)
for p in "$(python3 -c 'import sys; print(sys.base_prefix)')" "$(python3 -c 'import sys; print(sys.prefix)')"; do
  while [ "$p" != / ] && [ -n "$p" ]; do chmod o+x "$p" 2>/dev/null; p=$(dirname "$p"); done
done
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
base=/run/gpmps-probe
rm -rf "$base"; mkdir -p "$base/pipe" "$base/log"; chmod 711 "$base"
chown "$U:$G" "$base/pipe" "$base/log"; chmod 700 "$base/pipe" "$base/log"
cenv=(env -i PATH="$PATH" HOME=/tmp CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY="$base/pipe" CUDA_MPS_LOG_DIRECTORY="$base/log")
runuser -u "$U" -- "${cenv[@]}" nvidia-cuda-mps-control -d; echo "daemon start rc=$?"
for _ in $(seq 50); do [ -S "$base/pipe/control" ] && break; sleep 0.1; done
server() { pgrep -u "$U" -f nvidia-cuda-mps-server >/dev/null && echo yes || echo no; }
client='import time, torch; t = time.monotonic(); torch.zeros(1, device="cuda").add_(1); torch.cuda.synchronize(); print(f"context {time.monotonic() - t:.3f} s", end=" ")'
one() {  # $1: label
  local before; before=$(server)
  printf '%s: ' "$1"
  timeout 60 runuser -u "$U" -- "${cenv[@]}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 "$PY" -c "$client"
  echo "rc=$? server before=$before after=$(server)"
}
echo "=== clients one after another, no other client connected"
for i in 1 2 3; do one "back-to-back $i"; done
for gap in 1 3 6; do sleep "$gap"; one "after ${gap} s idle"; done
echo "=== with a keeper client connected (1 % share, holds its context)"
runuser -u "$U" -- "${cenv[@]}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 "$PY" -c 'import sys, time, torch; torch.zeros(1, device="cuda"); torch.cuda.synchronize(); print("keeper ready", flush=True); time.sleep(90)' > "$base/keeper.out" 2>&1 &
keeper=$!
for _ in $(seq 300); do grep -q "keeper ready" "$base/keeper.out" && break; sleep 0.1; done
cat "$base/keeper.out"
for i in 1 2 3; do one "keeper, back-to-back $i"; done
for gap in 1 3 6; do sleep "$gap"; one "keeper, after ${gap} s idle"; done
kill "$keeper" 2>/dev/null; wait "$keeper" 2>/dev/null
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 | head -5
echo quit | runuser -u "$U" -- "${cenv[@]}" nvidia-cuda-mps-control; echo "daemon quit rc=$?"
sleep 1; pkill -9 -u "$U" -f nvidia-cuda-mps 2>/dev/null
echo "=== control.log"; cat "$base/log/control.log" 2>&1 | cut -c1-160 | tail -60
echo "=== server.log"; cat "$base/log/server.log" 2>&1 | cut -c1-160 | tail -40
rm -rf "$base"
