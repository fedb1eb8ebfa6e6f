#!/usr/bin/env bash
# On the GPU machine, as root: can a worker-user CUDA client join an MPS daemon, and with which
# layout? Each variant starts its own daemon on a private pipe directory (short path under
# /run), runs one CUDA client as gpupool-worker under a 30 % share, prints the client's answer
# and the daemon's own logs, and quits the daemon. Writes one log to stdout.
#   rootdaemon: the daemon as root (the agent's way), pipe/log dirs 0770 root:worker
#   userdaemon: the daemon itself as the worker user
set -u
U=gpupool-worker
id "$U" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$U"
G=$(id -g "$U")
PY=$(command -v python3)
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
probe='import os, torch; x = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize(); print("client ok", x.sum().item(), "pct", os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))'
for variant in rootdaemon userdaemon; do
  base=/run/gpmps-$variant
  rm -rf "$base"; mkdir -p "$base/pipe" "$base/log"; chmod 711 "$base"
  chgrp "$G" "$base/pipe" "$base/log"; chmod 770 "$base/pipe" "$base/log"
  denv=(env -i PATH="$PATH" HOME="$base" CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY="$base/pipe" CUDA_MPS_LOG_DIRECTORY="$base/log")
  echo "=== $variant"
  if [ "$variant" = rootlog ]; then
    touch "$base/log/server.log"; chown "$U:$G" "$base/log/server.log"; chmod 660 "$base/log/server.log"
  fi
  if [ "$variant" = userdaemon ]; then
    runuser -u "$U" -- "${denv[@]}" nvidia-cuda-mps-control -d; echo "daemon start rc=$?"
  else
    "${denv[@]}" nvidia-cuda-mps-control -d; echo "daemon start rc=$?"
  fi
  for _ in $(seq 50); do [ -S "$base/pipe/control" ] && break; sleep 0.1; done
  ls -la "$base/pipe" "$base/log"
  runuser -u "$U" -- env -i PATH="$PATH" HOME="$base" PYTHONPATH="${PYTHONPATH:-}" CUDA_VISIBLE_DEVICES="$UUID" \
    CUDA_MPS_PIPE_DIRECTORY="$base/pipe" CUDA_MPS_LOG_DIRECTORY="$base/log" \
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M \
    timeout 90 "$PY" -c "$probe" 2>&1 | tail -5
  echo "client rc=${PIPESTATUS[0]}"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 | head -5
  if [ "$variant" = userdaemon ]; then
    echo quit | runuser -u "$U" -- "${denv[@]}" nvidia-cuda-mps-control
  else
    echo quit | "${denv[@]}" nvidia-cuda-mps-control
  fi
  for _ in $(seq 50); do pgrep -f "nvidia-cuda-mps" >/dev/null || break; sleep 0.1; done
  echo "--- control.log"; tail -30 "$base/log/control.log" 2>/dev/null
  echo "--- server.log"; tail -30 "$base/log/server.log" 2>/dev/null
  pkill -9 -f 'nvidia-cuda-mps' 2>/dev/null
  rm -rf "$base"
done
# Two daemons on one GPU at once, the agent's layout where workers run as the worker user: the
# workers' (worker user, 30 %) and the direct slices' (root, 50 %), one client each, running
# bf16 matrix products together for 8 s; each prints its TFLOP/s.
echo "=== both"
mm='import json, os, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); n = 0; t0 = time.perf_counter()
while time.perf_counter() - t0 < 8: a @ b; n += 1
torch.cuda.synchronize(); dt = time.perf_counter() - t0
print(json.dumps({"uid": os.getuid(), "pct": os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "tflops": round(2 * 8192**3 * n / dt / 1e12, 1)}))'
for d in /run/gpmps-w /run/gpmps-r; do rm -rf "$d"; mkdir -p "$d/pipe" "$d/log"; chmod 711 "$d"; done
chown "$U:$G" /run/gpmps-w/pipe /run/gpmps-w/log; chmod 700 /run/gpmps-w/pipe /run/gpmps-w/log /run/gpmps-r/pipe /run/gpmps-r/log
wenv=(env -i PATH="$PATH" HOME=/run/gpmps-w CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY=/run/gpmps-w/pipe CUDA_MPS_LOG_DIRECTORY=/run/gpmps-w/log)
renv=(env -i PATH="$PATH" HOME=/run/gpmps-r CUDA_VISIBLE_DEVICES="$UUID" CUDA_MPS_PIPE_DIRECTORY=/run/gpmps-r/pipe CUDA_MPS_LOG_DIRECTORY=/run/gpmps-r/log)
runuser -u "$U" -- "${wenv[@]}" nvidia-cuda-mps-control -d
"${renv[@]}" nvidia-cuda-mps-control -d
sleep 1
runuser -u "$U" -- "${wenv[@]}" PYTHONPATH="${PYTHONPATH:-}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30 timeout 90 "$PY" -c "$mm" > /tmp/mm_w.out 2>&1 &
"${renv[@]}" PYTHONPATH="${PYTHONPATH:-}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 90 "$PY" -c "$mm" > /tmp/mm_r.out 2>&1 &
wait
echo "workers' daemon client:"; tail -3 /tmp/mm_w.out
echo "direct daemon client:"; tail -3 /tmp/mm_r.out
# alone, for comparison
"${renv[@]}" PYTHONPATH="${PYTHONPATH:-}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 90 "$PY" -c "$mm" 2>&1 | tail -1 | sed 's/^/direct alone: /'
echo quit | runuser -u "$U" -- "${wenv[@]}" nvidia-cuda-mps-control
echo quit | "${renv[@]}" nvidia-cuda-mps-control
for _ in $(seq 50); do pgrep -f "nvidia-cuda-mps" >/dev/null || break; sleep 0.1; done
echo "--- workers' control.log"; tail -8 /run/gpmps-w/log/control.log
echo "--- direct control.log"; tail -8 /run/gpmps-r/log/control.log
pkill -9 -f 'nvidia-cuda-mps' 2>/dev/null
rm -rf /run/gpmps-w /run/gpmps-r
