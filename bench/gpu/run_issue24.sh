#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, one GPU, torch 2.11 CUDA build): torch.distributed through a
# remote lease (issue 24), in at most ~5 minutes. (carry .whl)
#   bash bench/gpu/run_issue24.sh
# 1. bench/gpu/nccl_remote.py: an NCCL group of world size 1 formed by a CUDA worker for a rank
#    without a GPU; every collective, a DDP and an FSDP2 step against the same programs on the
#    client's CPU; the NCCL buffers the lease is charged. Summary on stdout, log in $OUT.
# 2. bench/ddp_remote.py --ranks 1: the DDP step of ResNet-50 and GPT-2-small, local NCCL on the
#    GPU against the same through the worker (the two-rank run needs two GPUs). JSON in $OUT.
# Each script stops the workers it started.
set -u
. bench/gpu/site.sh
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "nccl", torch.distributed.is_nccl_available())'
timeout -k 5 200 python3 bench/gpu/nccl_remote.py > "$OUT/nccl_remote.log" 2>&1
echo "nccl_remote rc=$?"
grep -v '^SUMMARY' "$OUT/nccl_remote.log" | cut -c1-600 | tail -15
timeout -k 5 120 python3 bench/ddp_remote.py --ranks 1 --device cuda --steps 8 --warmup 3 \
  --label h200_one_gpu --out "$OUT/ddp_remote_1gpu.json" > "$OUT/ddp_remote.log" 2>&1
echo "ddp_remote rc=$?"
tail -5 "$OUT/ddp_remote.log" | cut -c1-600
for f in pip.log build_ext.log; do [ -f "$OUT/$f" ] && { echo "--- $f"; tail -5 "$OUT/$f"; }; done
exit 0
