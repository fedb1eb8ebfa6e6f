#!/usr/bin/env bash
# On the GPU machine (nvidia-h200, torch 2.11 CUDA build): one part of PyTorch's OpInfo sweep
# with the worker on the GPU against the client's CPU (issue 21). The whole sweep is longer
# than one device command may run, so it is split into PARTS parts (default 4) by op:
#   bash bench/gpu/run_issue21_sweep.sh 1      # then 2, 3, 4; each within 7 minutes  (carry .whl,
#   made by `../shared/tools/device-wheels controller agent k8s programs`: expecttest)
# Part K runs `bench/opinfo_sweep.py --shard K/PARTS` (every PARTS-th op from the K-th), all
# three passes (fp32 and bf16 forward, fp32 backward), with a deadline that leaves the rest of
# the 7 minutes to setup: ops left out by it are counted, not silently dropped. The test
# process is a client without a GPU (CUDA_VISIBLE_DEVICES=), as a pool client is.
# stdout: per pass the pass %, mismatches (silent wrong values, each named), errors, their
# commonest causes; $OUT/opinfo_sweep_partK.json the whole report (label h200_cuda_worker_partK).
set -u
PART=${1:?usage: run_issue21_sweep.sh PART [PARTS]}
PARTS=${2:-4}
DEADLINE_S=${DEADLINE_S:-300}
. bench/gpu/site.sh
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
echo "part $PART of $PARTS, deadline ${DEADLINE_S} s"
GPUPOOL_TEST_WORKER_DEVICE=cuda:0 GPUPOOL_TEST_WORKER_GPUS=0 CUDA_VISIBLE_DEVICES= \
  timeout -k 5 $((DEADLINE_S + 90)) python3 bench/opinfo_sweep.py --shard "$PART/$PARTS" \
  --deadline-s "$DEADLINE_S" --label "h200_cuda_worker_part$PART" \
  --out "$OUT/opinfo_sweep_part$PART.json" > "$OUT/opinfo_part$PART.log" 2> "$OUT/opinfo_part$PART.err"
rc=$?
grep -v '^written to' "$OUT/opinfo_part$PART.log"
if [ "$rc" != 0 ]; then
  echo "the sweep's part $PART ended with rc=$rc (124: the timeout); its last words:"
  tail -15 "$OUT/opinfo_part$PART.err"
fi
for f in pip.log build_ext.log; do
  [ -s "$OUT/$f" ] && grep -qi error "$OUT/$f" && { echo "--- $f"; tail -5 "$OUT/$f"; }
done
pkill -9 -f 'gpupool[.]worker' 2>/dev/null
exit 0
