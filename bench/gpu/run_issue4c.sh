#!/usr/bin/env bash
# On the GPU machine: remote step times and round trip; every log straight into $OUT (no pipes,
# so a worker left behind cannot hold a pipe open).
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
timeout -k 5 200 python3 bench/remote_overhead.py --steps 10 --timeout 60 --only resnet50,gpt2,round_trip --out "$OUT/remote_overhead.json" > "$OUT/ro.log" 2>&1
echo "remote_overhead rc=$?" >> "$OUT/ro.log"
pkill -9 -f gpupool.worker
timeout -k 5 100 python3 bench/remote_overhead.py --steps 10 --timeout 60 --only resnet50,round_trip --spin-us 200 --out "$OUT/remote_overhead_spin.json" > "$OUT/ro_spin.log" 2>&1
echo "spin rc=$?" >> "$OUT/ro_spin.log"
pkill -9 -f gpupool.worker
exit 0
